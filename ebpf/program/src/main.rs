//! tokentap's kernel program: redirect the TCP connects of one cgroup to the transparent
//! listener, and remember where each was going.
//!
//! Mechanism only. Which ports are redirected and where to is policy, set by the loader in the
//! `POLICY` and `PORTS` maps; which processes is decided by the cgroup the loader attaches to.
//!
//! - `connect4` / `connect6` (cgroup/connect*): a TCP connect to a listed port is rewritten to
//!   the listener; the original destination and the connecting task's cgroup are stored under
//!   the socket's cookie (the cgroup tells a node agent which workload connected).
//! - `record_client` (sock_ops, TCP_CONNECT_CB): once the kernel has picked the client's own
//!   address and port, the original destination is re-keyed by that address, which is what the
//!   listener sees as its peer.
#![no_std]
#![no_main]

use aya_ebpf::bindings::BPF_SOCK_OPS_TCP_CONNECT_CB;
use aya_ebpf::helpers::{bpf_get_current_cgroup_id, bpf_get_socket_cookie};
use aya_ebpf::macros::{cgroup_sock_addr, map, sock_ops};
use aya_ebpf::maps::{Array, HashMap, LruHashMap};
use aya_ebpf::programs::{SockAddrContext, SockOpsContext};
use tokentap_ebpf_common::{Policy, Redirected, SockAddr, AF_INET, AF_INET6};

const IPPROTO_TCP: u32 = 6;
/// cgroup/connect programs return 1 to let the connect proceed.
const PROCEED: i32 = 1;

#[map]
static POLICY: Array<Policy> = Array::with_max_entries(1, 0);

#[map]
static PORTS: HashMap<u16, u8> = HashMap::with_max_entries(64, 0);

#[map]
static DEST_BY_COOKIE: LruHashMap<u64, Redirected> = LruHashMap::with_max_entries(16384, 0);

#[map]
static DEST_BY_CLIENT: LruHashMap<SockAddr, Redirected> = LruHashMap::with_max_entries(16384, 0);

/// `::ffff:0:0/96` third word, as it sits in memory.
const V4_MAPPED_WORD: u32 = 0x0000_ffff_u32.to_be();

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    let _ = redirect4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    let _ = redirect6(&ctx);
    PROCEED
}

#[sock_ops]
pub fn record_client(ctx: SockOpsContext) -> u32 {
    let _ = rekey_by_client(&ctx);
    0
}

/// The policy when redirection is on and `port` is listed.
#[inline(always)]
fn policy_for(port: u16) -> Option<&'static Policy> {
    let policy = POLICY.get(0)?;
    if policy.enabled == 0 {
        return None;
    }
    // SAFETY: the value is only read, and only its presence matters.
    unsafe { PORTS.get(&port)? };
    Some(policy)
}

#[inline(always)]
fn remember(ctx: &SockAddrContext, original: &SockAddr) -> Option<()> {
    // SAFETY: the context pointer is the program's own argument.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.sock_addr as *mut _) };
    let redirected = Redirected {
        dest: *original,
        _pad: 0,
        // SAFETY: no arguments; connect hooks run in the connecting task's context.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
    };
    DEST_BY_COOKIE.insert(&cookie, &redirected, 0).ok()
}

#[inline(always)]
fn redirect4(ctx: &SockAddrContext) -> Option<()> {
    // SAFETY: the kernel hands the program a valid bpf_sock_addr.
    let sa = unsafe { &mut *ctx.sock_addr };
    if sa.protocol != IPPROTO_TCP {
        return None;
    }
    let port = u16::from_be(sa.user_port as u16);
    let policy = policy_for(port)?;
    if sa.user_ip4 == policy.proxy_ip4 && port == policy.proxy_port {
        return None; // already going to the listener
    }
    let original = SockAddr {
        family: AF_INET,
        port,
        addr: [sa.user_ip4, 0, 0, 0],
    };
    remember(ctx, &original)?;
    sa.user_ip4 = policy.proxy_ip4;
    sa.user_port = policy.proxy_port.to_be() as u32;
    Some(())
}

#[inline(always)]
fn redirect6(ctx: &SockAddrContext) -> Option<()> {
    // SAFETY: as in redirect4.
    let sa = unsafe { &mut *ctx.sock_addr };
    if sa.protocol != IPPROTO_TCP {
        return None;
    }
    let port = u16::from_be(sa.user_port as u16);
    let policy = policy_for(port)?;
    let ip = sa.user_ip6;
    let v4_mapped = ip[0] == 0 && ip[1] == 0 && ip[2] == V4_MAPPED_WORD;
    let (original, target) = if v4_mapped {
        (
            SockAddr {
                family: AF_INET,
                port,
                addr: [ip[3], 0, 0, 0],
            },
            [0, 0, V4_MAPPED_WORD, policy.proxy_ip4],
        )
    } else {
        if policy.proxy_ip6 == [0; 4] {
            return None; // no IPv6 listener: leave IPv6 connects alone
        }
        (
            SockAddr {
                family: AF_INET6,
                port,
                addr: ip,
            },
            policy.proxy_ip6,
        )
    };
    if ip == target && port == policy.proxy_port {
        return None;
    }
    remember(ctx, &original)?;
    // One 4-byte store per word: the verifier's rule for user_ip6.
    sa.user_ip6[0] = target[0];
    sa.user_ip6[1] = target[1];
    sa.user_ip6[2] = target[2];
    sa.user_ip6[3] = target[3];
    sa.user_port = policy.proxy_port.to_be() as u32;
    Some(())
}

#[inline(always)]
fn rekey_by_client(ctx: &SockOpsContext) -> Option<()> {
    if ctx.op() != BPF_SOCK_OPS_TCP_CONNECT_CB {
        return None;
    }
    // SAFETY: the context pointer is the program's own argument.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops as *mut _) };
    // SAFETY: copied out at once.
    let original = unsafe { *DEST_BY_COOKIE.get(&cookie)? };
    let port = ctx.local_port() as u16;
    let client = match ctx.family() as u16 {
        AF_INET => SockAddr {
            family: AF_INET,
            port,
            addr: [ctx.local_ip4(), 0, 0, 0],
        },
        AF_INET6 => {
            let ip = ctx.local_ip6();
            if ip[0] == 0 && ip[1] == 0 && ip[2] == V4_MAPPED_WORD {
                SockAddr {
                    family: AF_INET,
                    port,
                    addr: [ip[3], 0, 0, 0],
                }
            } else {
                SockAddr {
                    family: AF_INET6,
                    port,
                    addr: ip,
                }
            }
        }
        _ => return None,
    };
    DEST_BY_CLIENT.insert(&client, &original, 0).ok()?;
    let _ = DEST_BY_COOKIE.remove(&cookie);
    Some(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
