//! The system calls task code is refused inside the sandbox, as seccomp filters the shim
//! installs on the command it runs (after it drops to the sandbox uid, before it execs).
//!
//! A deny list, not an allow list: task code is whatever a harness, a build or a test suite
//! runs (compilers, interpreters, package managers, browsers), and an allow list would break
//! some of it for no gain the namespaces, the dropped capabilities and `no_new_privs` do not
//! already give. What is refused is what reaches past the sandbox or the node's kernel
//! surface:
//! - `ioctl` `TIOCSTI` and `TIOCLINUX`: pushing input into a terminal (the operator's, were a
//!   terminal ever reachable; `--new-session` already keeps it from being one);
//! - user namespaces (`unshare`/`clone` with `CLONE_NEWUSER`): the way back to capabilities
//!   (and to mount, bpf, and every other namespace) for an unprivileged process;
//! - `clone3` answers `ENOSYS` (its flags are behind a pointer a filter cannot read), so libc
//!   falls back to `clone`, whose flags it can;
//! - `keyctl`, `add_key`, `request_key`: the kernel keyrings are shared by uid, not by sandbox;
//! - `bpf`, `perf_event_open`: kernel attack surface and a window on other processes;
//! - `mount` and the new mount API, `umount2`, `pivot_root`, `setns`: the sandbox's view of
//!   the file system is the node's to set;
//! - modules, `kexec`, `reboot`, `swapon`/`swapoff`, `acct`, `userfaultfd` (a classic
//!   exploit aid), `open_by_handle_at`, and on x86 `iopl`/`ioperm`.
//!
//! Left allowed, on purpose: `ptrace` (debuggers and test runners use it; the PID namespace
//! and the uid limit it to the sample's own processes), `personality`, `io_uring`.
//! A refused call fails with `EPERM`, as if the sandbox lacked the privilege, so programs
//! that probe for a feature carry on without it. A system call made through another ABI
//! (32-bit `int 0x80`) kills the process: the filters only know the native numbers; the x32
//! numbers of every refused call are refused too, for kernels built with x32.

use std::collections::BTreeMap;
use std::io;
use std::sync::LazyLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Calls refused whatever their arguments.
const REFUSED: &[libc::c_long] = &[
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_setns,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_userfaultfd,
    libc::SYS_open_by_handle_at,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
];

/// Terminal requests refused to `ioctl` (its request argument is an `unsigned int`).
const REFUSED_IOCTLS: &[libc::c_ulong] = &[libc::TIOCSTI, libc::TIOCLINUX];

/// The x32 ABI's calls are the native numbers with this bit (same audit architecture, so the
/// filters' architecture check lets them through).
#[cfg(target_arch = "x86_64")]
const X32_BIT: libc::c_long = 0x4000_0000;
/// x32's own `ioctl` (its pointer-sized arguments differ from the native one's).
#[cfg(target_arch = "x86_64")]
const X32_IOCTL: libc::c_long = X32_BIT + 514;

/// The sandbox's filters, compiled once per process: refusals with `EPERM`, then `clone3`
/// with `ENOSYS` (a filter has one action for its matches, and these differ).
pub static SANDBOX_FILTERS: LazyLock<Vec<BpfProgram>> =
    LazyLock::new(|| build().expect("the sandbox's seccomp filters compile"));

fn arch() -> Result<TargetArch, seccompiler::Error> {
    std::env::consts::ARCH.try_into().map_err(Into::into)
}

/// Each native call number, and on x86_64 its x32 twin.
/// (`c_long` is `i64` on the 64-bit targets the filters are built for.)
fn with_x32(nr: libc::c_long) -> impl Iterator<Item = i64> {
    #[cfg(target_arch = "x86_64")]
    let twins = [Some(nr), Some(nr | X32_BIT)];
    #[cfg(not(target_arch = "x86_64"))]
    let twins = [Some(nr), None];
    twins.into_iter().flatten()
}

fn build() -> Result<Vec<BpfProgram>, seccompiler::Error> {
    let masked = |arg, bits: u64| {
        SeccompCondition::new(
            arg,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(bits),
            bits,
        )
    };
    let mut refused: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &nr in REFUSED {
        for nr in with_x32(nr) {
            // No rule: refused whatever the arguments.
            refused.insert(nr, Vec::new());
        }
    }
    let newuser = libc::CLONE_NEWUSER as u64;
    for nr in with_x32(libc::SYS_unshare).chain(with_x32(libc::SYS_clone)) {
        // unshare(flags) and, on x86_64 and aarch64, clone(flags, ...): flags are argument 0.
        refused.insert(nr, vec![SeccompRule::new(vec![masked(0, newuser)?])?]);
    }
    let ioctl_rules = REFUSED_IOCTLS
        .iter()
        .map(|&req| {
            SeccompRule::new(vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                req,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    refused.insert(libc::SYS_ioctl, ioctl_rules.clone());
    #[cfg(target_arch = "x86_64")]
    refused.insert(X32_IOCTL, ioctl_rules);
    let refusals = SeccompFilter::new(
        refused,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )?;
    let clone3: BTreeMap<i64, Vec<SeccompRule>> = with_x32(libc::SYS_clone3)
        .map(|nr| (nr, Vec::new()))
        .collect();
    let clone3 = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch()?,
    )?;
    Ok(vec![refusals.try_into()?, clone3.try_into()?])
}

/// Installs `filters` on the calling thread (and so on what it execs). Only system calls: safe
/// between fork and exec, where the shim calls it.
pub fn install(filters: &[BpfProgram]) -> io::Result<()> {
    for f in filters {
        if seccompiler::apply_filter(f).is_err() {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A system call tried in a child: its return value (-1 with errno set on failure, below
    /// -1 when the probe's own set-up failed).
    type Probe = fn() -> libc::c_long;

    /// What each probe got in a forked child: 0 for success, else the errno.
    fn probe_in_child(filtered: bool) -> Vec<(&'static str, i32)> {
        let probes: Vec<(&'static str, Probe)> = vec![
            ("unshare(CLONE_NEWUSER)", || unsafe {
                libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER)
            }),
            ("keyctl(JOIN_SESSION_KEYRING)", || unsafe {
                // KEYCTL_JOIN_SESSION_KEYRING with no name: a new anonymous keyring.
                libc::syscall(libc::SYS_keyctl, 1, 0)
            }),
            ("perf_event_open", || unsafe {
                let mut attr: [u64; 16] = [0; 16];
                // type PERF_TYPE_SOFTWARE (1), size 128, config CPU_CLOCK (0), flags:
                // disabled | exclude_kernel | exclude_hv.
                attr[0] = 1 | (128 << 32);
                attr[5] = 1 | (1 << 5) | (1 << 6);
                libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), 0, -1, -1, 0)
            }),
            ("mount", || unsafe {
                // In a mount namespace of the child's own (unshare is not refused without
                // CLONE_NEWUSER): making its mounts private touches nothing of the host's.
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return -5;
                }
                libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                )
                .into()
            }),
            ("TIOCSTI", || unsafe {
                let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
                if master < 0 || libc::grantpt(master) != 0 || libc::unlockpt(master) != 0 {
                    return -2;
                }
                let name = libc::ptsname(master);
                if libc::setsid() < 0 {
                    return -3;
                }
                // Opened without O_NOCTTY by a session leader: its controlling terminal,
                // the one terminal TIOCSTI works on without privileges.
                let slave = libc::open(name, libc::O_RDWR);
                if slave < 0 {
                    return -4;
                }
                let byte = b'x';
                libc::ioctl(slave, libc::TIOCSTI, &byte).into()
            }),
            ("clone3", || unsafe {
                libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0)
            }),
        ];
        let filters = SANDBOX_FILTERS.clone();
        let mut results = Vec::new();
        for (name, probe) in probes {
            let mut pipe = [0; 2];
            assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
            // SAFETY: the child only makes system calls and exits.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                if filtered && install(&filters).is_err() {
                    unsafe { libc::_exit(100) };
                }
                let errno = match probe() {
                    r if r >= 0 => 0,
                    r if r < -1 => r as i32,
                    _ => io::Error::last_os_error().raw_os_error().unwrap_or(-1),
                };
                unsafe {
                    libc::write(pipe[1], (&errno as *const i32).cast(), 4);
                    libc::_exit(0)
                };
            }
            let mut errno = 0i32;
            let n = unsafe { libc::read(pipe[0], (&mut errno as *mut i32).cast(), 4) };
            let mut status = 0;
            unsafe {
                libc::waitpid(pid, &mut status, 0);
                libc::close(pipe[0]);
                libc::close(pipe[1]);
            }
            assert_eq!(n, 4, "{name}: the child did not report (status {status})");
            results.push((name, errno));
        }
        results
    }

    /// As root (CI's nodes run as root), every probe succeeds unfiltered, each in a child of
    /// its own, so the test can fail; filtered, each is refused with EPERM (clone3 ENOSYS, which
    /// libc takes as "use clone"). clone3 with a null argument is EFAULT/EINVAL unfiltered.
    #[test]
    fn the_filters_refuse_what_they_say_and_nothing_runs_without_them() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if !tokentap_e2e::privileged::runs(if root {
            Ok(())
        } else {
            Err("needs root: the unfiltered probes (mount, perf) are the positive control".into())
        }) {
            return;
        }
        let open = probe_in_child(false);
        for (name, errno) in &open {
            match *name {
                "clone3" => assert!(
                    [libc::EFAULT, libc::EINVAL].contains(errno),
                    "{name}: {errno}"
                ),
                _ => assert_eq!(*errno, 0, "positive control: {name} works unfiltered"),
            }
        }
        let filtered = probe_in_child(true);
        for (name, errno) in &filtered {
            let want = if *name == "clone3" {
                libc::ENOSYS
            } else {
                libc::EPERM
            };
            assert_eq!(*errno, want, "{name} under the filters");
        }
    }

    /// Ordinary work still runs under the filters: threads (glibc tries clone3 first), a
    /// child process, other ioctls on a terminal, unshare of nothing.
    #[test]
    fn ordinary_programs_run_under_the_filters() {
        let filters = SANDBOX_FILTERS.clone();
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            "(sleep 0 & wait) && stty -a </dev/null >/dev/null 2>&1; \
             python3 -c 'import threading; t=threading.Thread(target=print, args=(\"thread\",)); t.start(); t.join()'",
        ]);
        // SAFETY: install makes system calls only.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || install(&filters));
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "thread");
    }
}
