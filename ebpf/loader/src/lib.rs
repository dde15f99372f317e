//! Userspace side of tokentap's transparent capture: loads the kernel program
//! (`ebpf/program`), sets its policy maps, attaches it to cgroups (v2), and answers "where
//! was this connection going, and which cgroup made it?" for the connections it redirected.
//!
//! Dropping a [`Redirect`] detaches everything: the links are file descriptors owned by this
//! process, so the kernel also detaches them if the process dies.

mod nft;

use std::fs::File;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::path::Path;
use std::sync::Mutex;

use aya::maps::{Array, HashMap, MapData};
use aya::programs::cgroup_sock_addr::CgroupSockAddrLink;
use aya::programs::sock_ops::SockOpsLink;
use aya::programs::{CgroupAttachMode, CgroupSockAddr, SockOps};
use aya::{include_bytes_aligned, Ebpf};
use tokentap_ebpf_common::{Policy, Redirected, SockAddr, AF_INET, AF_INET6};

pub use nft::{conntrack_original_destination, remove_stale_tables, NftError, NftRedirect};

/// The kernel object built by `build.rs` (empty when the eBPF toolchain was missing).
static OBJECT: &[u8] = include_bytes_aligned!(env!("TOKENTAP_EBPF_OBJECT"));

/// Where and what to redirect.
#[derive(Debug, Clone)]
pub struct RedirectConfig {
    /// The transparent listener for IPv4 (and IPv4-mapped IPv6) connects.
    pub listener: SocketAddrV4,
    /// The listener's IPv6 address (same port), if it listens on one; IPv6 connects are left
    /// alone otherwise.
    pub listener_v6: Option<Ipv6Addr>,
    /// Destination ports whose TCP connects are redirected.
    pub ports: Vec<u16>,
}

#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("this tokentap was built without its eBPF program (nightly, rust-src and bpf-linker were missing at build time): run scripts/setup --only ebpf and rebuild, or use the nftables fallback (--redirect nft)")]
    NotBuilt,
    #[error("loading eBPF programs needs root (CAP_BPF and CAP_NET_ADMIN); run as root, or use the nftables fallback (--redirect nft), which also needs root")]
    NotRoot,
    #[error(
        "the kernel refused the eBPF program ({0}); use the nftables fallback (--redirect nft)"
    )]
    Refused(String),
    #[error("cannot open the cgroup {path}: {source}")]
    Cgroup {
        path: String,
        source: std::io::Error,
    },
}

/// Checks what redirecting needs before anything is created: the built program (for eBPF),
/// root, and a cgroup v2 hierarchy. Each error names what is missing and the fallback.
pub fn preflight(ebpf: bool) -> Result<std::path::PathBuf, RedirectError> {
    if ebpf && OBJECT.is_empty() {
        return Err(RedirectError::NotBuilt);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(RedirectError::NotRoot);
    }
    tokentap_cgroup::cgroup2_mount().map_err(|e| RedirectError::Refused(e.to_string()))
}

/// The loaded program with its policy, attached to one or more cgroups. Dropping it detaches
/// every attachment it still owns.
pub struct Redirect {
    ebpf: Mutex<Ebpf>,
    clients: Mutex<HashMap<MapData, SockAddr, Redirected>>,
    /// The attachment made by [`Redirect::attach`] (one cgroup, for the life of the redirect).
    _own: Option<Attachment>,
}

/// One cgroup's attachment of the program (its three links); detached when dropped. Programs
/// attached to a cgroup apply to every cgroup below it, including ones created later.
pub struct Attachment {
    _connect4: CgroupSockAddrLink,
    _connect6: CgroupSockAddrLink,
    _record_client: SockOpsLink,
}

/// Where a redirected connection was going, and the cgroup of the task that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub destination: SocketAddr,
    /// The cgroup v2 id (its directory's inode number) the connecting task was in: the
    /// attached cgroup itself or one below it.
    pub cgroup_id: u64,
}

impl Redirect {
    /// Loads the program, writes `config` into its maps and attaches it to `cgroup_dir`.
    pub fn attach(cgroup_dir: &Path, config: &RedirectConfig) -> Result<Redirect, RedirectError> {
        let mut redirect = Redirect::load(config)?;
        redirect._own = Some(redirect.attach_cgroup(cgroup_dir)?);
        Ok(redirect)
    }

    /// Loads the program and writes `config` into its maps, attached nowhere yet: the node
    /// agent's one program for every workload it captures ([`Redirect::attach_cgroup`]).
    pub fn load(config: &RedirectConfig) -> Result<Redirect, RedirectError> {
        if OBJECT.is_empty() {
            return Err(RedirectError::NotBuilt);
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(RedirectError::NotRoot);
        }
        let refused = |e: &dyn std::fmt::Display| RedirectError::Refused(e.to_string());
        let failed = |e: &dyn std::error::Error| RedirectError::Refused(chain(e));
        let mut ebpf = Ebpf::load(OBJECT).map_err(|e| failed(&e))?;

        let policy = Policy {
            proxy_ip4: u32::from_ne_bytes(config.listener.ip().octets()),
            proxy_ip6: config.listener_v6.map(ip6_words).unwrap_or([0; 4]),
            proxy_port: config.listener.port(),
            enabled: 1,
            _pad: 0,
        };
        let mut policy_map: Array<_, Policy> = Array::try_from(
            ebpf.map_mut("POLICY")
                .ok_or_else(|| refused(&"no POLICY map"))?,
        )
        .map_err(|e| refused(&e))?;
        policy_map.set(0, policy, 0).map_err(|e| refused(&e))?;
        let mut ports: HashMap<_, u16, u8> = HashMap::try_from(
            ebpf.map_mut("PORTS")
                .ok_or_else(|| refused(&"no PORTS map"))?,
        )
        .map_err(|e| refused(&e))?;
        for p in &config.ports {
            ports.insert(p, 1, 0).map_err(|e| refused(&e))?;
        }
        for name in ["connect4", "connect6"] {
            let program: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or_else(|| refused(&format!("no {name} program")))?
                .try_into()
                .map_err(|e| refused(&e))?;
            program.load().map_err(|e| failed(&e))?;
        }
        let program: &mut SockOps = ebpf
            .program_mut("record_client")
            .ok_or_else(|| refused(&"no record_client program"))?
            .try_into()
            .map_err(|e| refused(&e))?;
        program.load().map_err(|e| failed(&e))?;

        let clients = HashMap::try_from(
            ebpf.take_map("DEST_BY_CLIENT")
                .ok_or_else(|| refused(&"no DEST_BY_CLIENT map"))?,
        )
        .map_err(|e| refused(&e))?;
        tracing::debug!(?config, "connect redirect loaded");
        Ok(Redirect {
            ebpf: Mutex::new(ebpf),
            clients: Mutex::new(clients),
            _own: None,
        })
    }

    /// Attaches the loaded program to one more cgroup (v2 directory).
    pub fn attach_cgroup(&self, cgroup_dir: &Path) -> Result<Attachment, RedirectError> {
        let refused = |e: &dyn std::fmt::Display| RedirectError::Refused(e.to_string());
        let failed = |e: &dyn std::error::Error| RedirectError::Refused(chain(e));
        let cgroup = File::open(cgroup_dir).map_err(|source| RedirectError::Cgroup {
            path: cgroup_dir.display().to_string(),
            source,
        })?;
        let mut ebpf = self.ebpf.lock().unwrap_or_else(|e| e.into_inner());
        // On kernels with BPF links (5.7+) the attachment is a link, which never excludes other
        // tools' programs; `Single` is the mode links take (they refuse the others' flags).
        let mode = CgroupAttachMode::Single;
        let mut sock_addr_link = |name: &str| -> Result<CgroupSockAddrLink, RedirectError> {
            let program: &mut CgroupSockAddr = ebpf
                .program_mut(name)
                .ok_or_else(|| refused(&format!("no {name} program")))?
                .try_into()
                .map_err(|e| refused(&e))?;
            let id = program.attach(&cgroup, mode).map_err(|e| failed(&e))?;
            program.take_link(id).map_err(|e| failed(&e))
        };
        let connect4 = sock_addr_link("connect4")?;
        let connect6 = sock_addr_link("connect6")?;
        let program: &mut SockOps = ebpf
            .program_mut("record_client")
            .ok_or_else(|| refused(&"no record_client program"))?
            .try_into()
            .map_err(|e| refused(&e))?;
        let id = program.attach(&cgroup, mode).map_err(|e| failed(&e))?;
        let record_client = program.take_link(id).map_err(|e| failed(&e))?;
        tracing::info!(cgroup = %cgroup_dir.display(), "connect redirect attached");
        Ok(Attachment {
            _connect4: connect4,
            _connect6: connect6,
            _record_client: record_client,
        })
    }

    /// Where the redirected connection whose client end is `client` (the listener's peer) was
    /// going; the entry is consumed.
    pub fn original_destination(&self, client: SocketAddr) -> Option<SocketAddr> {
        self.origin(client).map(|o| o.destination)
    }

    /// Where the redirected connection whose client end is `client` was going and which cgroup
    /// made it; the entry is consumed.
    pub fn origin(&self, client: SocketAddr) -> Option<Origin> {
        let key = sock_addr(client);
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let found = clients.get(&key, 0).ok()?;
        let _ = clients.remove(&key);
        Some(Origin {
            destination: socket_addr(found.dest),
            cgroup_id: found.cgroup_id,
        })
    }
}

/// An error with its causes, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

fn ip6_words(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

/// The map key for a socket address, as the kernel program writes it (IPv4-mapped IPv6 as
/// IPv4).
pub fn sock_addr(a: SocketAddr) -> SockAddr {
    let a = match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::V4(SocketAddrV4::new(v4, v6.port())),
            None => a,
        },
        v4 => v4,
    };
    match a {
        SocketAddr::V4(v4) => SockAddr {
            family: AF_INET,
            port: v4.port(),
            addr: [u32::from_ne_bytes(v4.ip().octets()), 0, 0, 0],
        },
        SocketAddr::V6(v6) => SockAddr {
            family: AF_INET6,
            port: v6.port(),
            addr: ip6_words(*v6.ip()),
        },
    }
}

/// The socket address a map value names.
pub fn socket_addr(s: SockAddr) -> SocketAddr {
    if s.family == AF_INET {
        SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(s.addr[0].to_ne_bytes()),
            s.port,
        ))
    } else {
        let mut o = [0u8; 16];
        for (i, w) in s.addr.iter().enumerate() {
            o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
        }
        SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(o), s.port, 0, 0))
    }
}

/// Takes down the cgroups and nftables redirects a killed tokentap left behind (their
/// processes are gone; their rules would redirect to a dead port). Returns how many it took
/// down; without cgroups or `nft` to look at there is nothing to take down.
pub fn remove_stale_interception() -> usize {
    let cgroups = match tokentap_cgroup::run_cgroup::remove_stale() {
        Ok(removed) => removed.len(),
        Err(e) => {
            tracing::debug!(error = %e, "no stale cgroups looked for");
            0
        }
    };
    cgroups + remove_stale_tables().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_through_the_kernel_layout() {
        for a in ["127.0.0.2:443", "[::1]:8443", "[2001:db8::7]:443"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(socket_addr(sock_addr(a)), a);
        }
        // IPv4-mapped IPv6 peers are keyed as IPv4, as the kernel program keys them.
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:40000".parse().unwrap();
        assert_eq!(
            socket_addr(sock_addr(mapped)),
            "127.0.0.1:40000".parse::<SocketAddr>().unwrap()
        );
        // Network order in memory: 127.0.0.1's first byte is 127.
        let k = sock_addr("127.0.0.1:1".parse().unwrap());
        assert_eq!(k.addr[0].to_ne_bytes(), [127, 0, 0, 1]);
    }

    #[test]
    fn stale_interception_once_taken_down_is_gone() {
        // Only what dead processes left is touched (what every `tokentap run` does at start),
        // with or without the privileges to look: right after, there is nothing left.
        remove_stale_interception();
        assert_eq!(remove_stale_interception(), 0);
    }
}
