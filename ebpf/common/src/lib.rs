//! Map layouts shared by the kernel program (`ebpf/program`) and the loader (`ebpf/loader`).
//! Addresses are kept exactly as the kernel holds them (network byte order in memory, one
//! `u32` per 4 bytes); ports in host order.
#![no_std]

/// Redirect policy: the single entry of the `POLICY` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// IPv4 address of the transparent listener (network order in memory).
    pub proxy_ip4: u32,
    /// IPv6 address of the transparent listener (network order words), for IPv6 connects.
    pub proxy_ip6: [u32; 4],
    /// Port of the transparent listener (host order).
    pub proxy_port: u16,
    /// 0 disables redirection without detaching.
    pub enabled: u8,
    pub _pad: u8,
}

/// Address family values as the kernel writes them.
pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;

/// A socket address: a connect's original destination, or the client end of a redirected
/// connection (which the proxy sees as its peer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockAddr {
    /// [`AF_INET`] or [`AF_INET6`]; IPv4 uses `addr[0]` and leaves the rest 0.
    pub family: u16,
    /// Host order.
    pub port: u16,
    /// Network order in memory.
    pub addr: [u32; 4],
}

/// A redirected connect, as the kernel remembers it: where it was going and which cgroup (v2 id,
/// the inode number of its directory) the connecting task was in. The node agent maps the
/// cgroup to a workload and its session; `run` and `serve` capture one cgroup and ignore it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Redirected {
    pub dest: SockAddr,
    pub _pad: u32,
    pub cgroup_id: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Policy {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for Redirected {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for SockAddr {}
