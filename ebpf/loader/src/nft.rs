//! The fallback redirect for hosts where eBPF is unavailable: an nftables `nat output` rule
//! that REDIRECTs the target cgroup's TCP connects to the listener. The original destination
//! then comes from conntrack (`SO_ORIGINAL_DST` on the accepted socket).
//!
//! Same policy as the eBPF program: only sockets of the target cgroup, only the listed ports.

use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::sys::socket::{getsockopt, sockopt};

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("the nftables fallback needs the `nft` command (Debian package nftables): {0}")]
    NoNft(std::io::Error),
    #[error("the cgroup {0} is not under the cgroup v2 mount {1}")]
    CgroupOutside(String, String),
    #[error("nft refused the redirect rule: {0}")]
    Refused(String),
}

/// An installed redirect table; deleted on drop.
#[derive(Debug)]
pub struct NftRedirect {
    table: String,
}

impl NftRedirect {
    /// Redirects TCP connects to `ports` from processes in `cgroup` (a directory under the
    /// cgroup v2 mount `root`) to `listener_port` on loopback.
    pub fn install(
        root: &Path,
        cgroup: &Path,
        ports: &[u16],
        listener_port: u16,
    ) -> Result<NftRedirect, NftError> {
        let rel = cgroup.strip_prefix(root).map_err(|_| {
            NftError::CgroupOutside(cgroup.display().to_string(), root.display().to_string())
        })?;
        let level = rel.components().count();
        // Named after this process too, so a later start can tell a killed run's table.
        let table = format!(
            "tokentap_{}_pid{}",
            rel.to_string_lossy()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect::<String>(),
            std::process::id()
        );
        let ports = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let script = format!(
            "table inet {table} {{\n  chain output {{\n    type nat hook output priority -100; policy accept;\n    meta l4proto tcp socket cgroupv2 level {level} \"{}\" tcp dport {{ {ports} }} redirect to :{listener_port}\n  }}\n}}\n",
            rel.display()
        );
        // nft resolves cgroupv2 paths under /sys/fs/cgroup; on hybrid hosts the v2 hierarchy is
        // elsewhere, so nft then runs where it is bind-mounted there (a private mount namespace).
        let mount = (root != Path::new("/sys/fs/cgroup")).then_some(root);
        nft(&["-f", "-"], Some(&script), mount)?;
        tracing::info!(%table, cgroup = %cgroup.display(), "nftables redirect installed");
        Ok(NftRedirect { table })
    }
}

/// Deletes the redirect tables of tokentap processes that are gone (a killed run's), so their
/// rules stop redirecting to a dead port. Returns the tables deleted. Without `nft` there is
/// nothing to clean.
pub fn remove_stale_tables() -> Vec<String> {
    let Ok(listing) = nft(&["list", "tables", "inet"], None, None) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for table in stale_tables(&listing, |pid| Path::new(&format!("/proc/{pid}")).exists()) {
        match nft(&["delete", "table", "inet", &table], None, None) {
            Ok(_) => {
                tracing::warn!(%table, "removed an nftables redirect left by a killed tokentap run");
                removed.push(table);
            }
            Err(e) => {
                tracing::warn!(error = %e, %table, "could not remove a stale nftables redirect")
            }
        }
    }
    removed
}

/// The tokentap tables in `nft list tables` output whose creator is not alive.
fn stale_tables(listing: &str, alive: impl Fn(u32) -> bool) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .map(str::trim)
        .filter(|t| t.starts_with("tokentap_"))
        .filter(|t| {
            t.rsplit_once("_pid")
                .and_then(|(_, pid)| pid.parse::<u32>().ok())
                .is_some_and(|pid| pid != std::process::id() && !alive(pid))
        })
        .map(str::to_owned)
        .collect()
}

impl Drop for NftRedirect {
    fn drop(&mut self) {
        if let Err(e) = nft(&["delete", "table", "inet", &self.table], None, None) {
            tracing::warn!(error = %e, table = %self.table, "could not remove the nftables redirect");
        }
    }
}

fn nft(args: &[&str], stdin: Option<&str>, cgroup2_at: Option<&Path>) -> Result<String, NftError> {
    let mut cmd = match cgroup2_at {
        None => Command::new("nft"),
        Some(root) => {
            let mut c = Command::new("unshare");
            c.args(["-m", "--propagation", "private", "sh", "-c"])
                .arg("mount --bind \"$0\" /sys/fs/cgroup && exec nft \"$@\"")
                .arg(root);
            c
        }
    };
    let mut child = cmd
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftError::NoNft)?;
    if let Some(s) = stdin {
        let _ = child.stdin.take().expect("piped").write_all(s.as_bytes());
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().map_err(NftError::NoNft)?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(NftError::Refused(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ))
    }
}

/// Where a REDIRECTed connection was going, from conntrack (`SO_ORIGINAL_DST`, and
/// `IP6T_SO_ORIGINAL_DST` for IPv6).
pub fn conntrack_original_destination(conn: &impl AsFd, peer: SocketAddr) -> Option<SocketAddr> {
    match peer {
        SocketAddr::V4(_) => {
            let sa = getsockopt(conn, sockopt::OriginalDst).ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
                u16::from_be(sa.sin_port),
            )))
        }
        SocketAddr::V6(_) => {
            let sa = getsockopt(conn, sockopt::Ip6tOriginalDst).ok()?;
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sa.sin6_addr.s6_addr),
                u16::from_be(sa.sin6_port),
                0,
                0,
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_tables_are_those_of_dead_tokentap_processes() {
        let listing = "table inet filter\ntable inet tokentap_tokentap_run_a_pid100\ntable inet tokentap_tokentap_run_b_pid200\ntable inet tokentap_old\n";
        assert_eq!(
            stale_tables(listing, |pid| pid == 200),
            vec!["tokentap_tokentap_run_a_pid100".to_owned()]
        );
    }
}
