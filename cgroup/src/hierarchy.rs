//! Where the cgroup hierarchies are mounted (`/proc/self/mountinfo`) and where this process
//! sits in each (`/proc/self/cgroup`). A unified (v2) host has one hierarchy; a hybrid host
//! has v1 hierarchies per controller beside a v2 one (often `/sys/fs/cgroup/unified`) that
//! holds no controllers but still places every process (the eBPF redirect attaches there).

use std::io;
use std::path::{Path, PathBuf};

/// A mounted cgroup filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// `cgroup2`, or `cgroup` for a v1 hierarchy.
    pub fstype: String,
    pub dir: PathBuf,
    /// Super options: for v1, the controllers it carries (`rw,memory`).
    pub options: String,
}

impl Mount {
    pub fn is_v2(&self) -> bool {
        self.fstype == "cgroup2"
    }

    /// Whether this v1 hierarchy carries `controller`.
    pub fn carries(&self, controller: &str) -> bool {
        !self.is_v2() && self.options.split(',').any(|o| o == controller)
    }
}

/// One line of `/proc/<pid>/cgroup`: the controllers of a hierarchy (empty for v2) and the
/// process's path in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub controllers: String,
    pub path: String,
}

impl Membership {
    pub fn is_v2(&self) -> bool {
        self.controllers.is_empty()
    }

    pub fn has(&self, controller: &str) -> bool {
        self.controllers.split(',').any(|c| c == controller)
    }

    /// The directory of this membership under `mount`.
    pub fn dir_under(&self, mount: &Path) -> PathBuf {
        mount.join(self.path.trim().trim_start_matches('/'))
    }
}

/// The cgroup filesystems in a `mountinfo` text.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            // `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS`
            let (pre, post) = l.split_once(" - ")?;
            let dir = pre.split(' ').nth(4)?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let _source = post.next()?;
            let options = post.next().unwrap_or("");
            fstype.starts_with("cgroup").then(|| Mount {
                fstype: fstype.to_owned(),
                dir: PathBuf::from(unescape(dir)),
                options: options.to_owned(),
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4);
        match code.and_then(|c| u8::from_str_radix(c, 8).ok()) {
            Some(b) => {
                out.push(b as char);
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The memberships in a `/proc/<pid>/cgroup` text (`ID:controllers:path`; v2 is `0::path`).
pub fn parse_membership(text: &str) -> Vec<Membership> {
    text.lines()
        .filter_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, controllers, path) = (p.next()?, p.next()?, p.next()?);
            Some(Membership {
                controllers: controllers.to_owned(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// This host's cgroup filesystems.
pub fn mounts() -> io::Result<Vec<Mount>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// This process's cgroups.
pub fn own_membership() -> io::Result<Vec<Membership>> {
    Ok(parse_membership(&std::fs::read_to_string(
        "/proc/self/cgroup",
    )?))
}

/// The error when a host has no cgroup v2 hierarchy.
pub fn no_cgroup2() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        "no cgroup v2 hierarchy is mounted (looked for cgroup2 in /proc/self/mountinfo); mount one (mount -t cgroup2 none /sys/fs/cgroup)",
    )
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on
/// hybrid hosts).
pub fn cgroup2_mount() -> io::Result<PathBuf> {
    mounts()?
        .into_iter()
        .find(Mount::is_v2)
        .map(|m| m.dir)
        .ok_or_else(no_cgroup2)
}

/// The cgroup v2 directory this process is in.
pub fn own_cgroup() -> io::Result<PathBuf> {
    let mount = cgroup2_mount()?;
    own_membership()?
        .iter()
        .find(|m| m.is_v2())
        .map(|m| m.dir_under(&mount))
        .ok_or_else(no_cgroup2)
}

/// Where a controller can be used by this process's children.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// This process's own cgroup directory in that hierarchy.
    pub own: PathBuf,
    pub v2: bool,
}

/// Where `controller` can be used: the v2 hierarchy if this process's v2 cgroup offers it,
/// else the v1 hierarchy that carries it.
pub fn hierarchy_for(controller: &str) -> io::Result<Hierarchy> {
    choose_hierarchy(&mounts()?, &own_membership()?, controller, |dir| {
        std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default()
    })
}

/// [`hierarchy_for`] on given mounts and memberships; `controllers_of` reads a v2 directory's
/// `cgroup.controllers`.
pub fn choose_hierarchy(
    mounts: &[Mount],
    own: &[Membership],
    controller: &str,
    controllers_of: impl Fn(&Path) -> String,
) -> io::Result<Hierarchy> {
    if let (Some(mount), Some(member)) = (
        mounts.iter().find(|m| m.is_v2()),
        own.iter().find(|m| m.is_v2()),
    ) {
        let dir = member.dir_under(&mount.dir);
        if controllers_of(&dir)
            .split_whitespace()
            .any(|c| c == controller)
        {
            return Ok(Hierarchy { own: dir, v2: true });
        }
    }
    let mount = mounts
        .iter()
        .find(|m| m.carries(controller))
        .ok_or_else(|| {
            io::Error::other(format!(
                "no cgroup hierarchy offers the {controller} controller"
            ))
        })?;
    let member = own
        .iter()
        .find(|m| !m.is_v2() && m.has(controller))
        .ok_or_else(|| io::Error::other(format!("this process is in no {controller} cgroup")))?;
    Ok(Hierarchy {
        own: member.dir_under(&mount.dir),
        v2: false,
    })
}

/// This process's own directories in the v2 hierarchy and in every v1 hierarchy carrying one
/// of `controllers` (each once).
pub fn own_dirs(controllers: &[&str]) -> io::Result<Vec<PathBuf>> {
    Ok(own_dirs_in(&mounts()?, &own_membership()?, controllers))
}

fn own_dirs_in(mounts: &[Mount], own: &[Membership], controllers: &[&str]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for mount in mounts {
        let member = own.iter().find(|m| {
            if mount.is_v2() {
                m.is_v2()
            } else {
                controllers
                    .iter()
                    .any(|c| mount.carries(c) && !m.is_v2() && m.has(c))
            }
        });
        if let Some(m) = member {
            let dir = m.dir_under(&mount.dir);
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hybrid host (this machine's layout): v1 controllers, v2 at /sys/fs/cgroup/unified.
    const HYBRID_MOUNTINFO: &str = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 33 0:30 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
38 33 0:33 / /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory
39 33 0:34 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu,cpuacct
40 33 0:35 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,pids
";
    const HYBRID_CGROUP: &str = "\
12:pids:/user.slice/session-1.scope
5:cpu,cpuacct:/user.slice
4:memory:/user.slice/session-1.scope
1:name=systemd:/user.slice/session-1.scope
0::/user.slice/session-1.scope
";
    const UNIFIED_MOUNTINFO: &str = "\
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
    const UNIFIED_CGROUP: &str = "0::/system.slice/tokentap.service\n";

    #[test]
    fn a_hybrid_hosts_hierarchies_are_found() {
        let mounts = parse_mountinfo(HYBRID_MOUNTINFO);
        assert_eq!(mounts.len(), 5, "{mounts:?}");
        assert_eq!(
            mounts.iter().find(|m| m.is_v2()).unwrap().dir,
            Path::new("/sys/fs/cgroup/unified")
        );
        let own = parse_membership(HYBRID_CGROUP);
        // The v2 hierarchy of a hybrid host offers no controllers: each comes from v1.
        let none = |_: &Path| String::new();
        let memory = choose_hierarchy(&mounts, &own, "memory", none).unwrap();
        assert_eq!(
            memory,
            Hierarchy {
                own: "/sys/fs/cgroup/memory/user.slice/session-1.scope".into(),
                v2: false
            }
        );
        let cpu = choose_hierarchy(&mounts, &own, "cpu", none).unwrap();
        assert_eq!(cpu.own, Path::new("/sys/fs/cgroup/cpu,cpuacct/user.slice"));
        assert!(choose_hierarchy(&mounts, &own, "io", none).is_err());
        assert_eq!(
            own_dirs_in(&mounts, &own, &["memory", "pids"]),
            [
                "/sys/fs/cgroup/unified/user.slice/session-1.scope",
                "/sys/fs/cgroup/memory/user.slice/session-1.scope",
                "/sys/fs/cgroup/pids/user.slice/session-1.scope",
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn a_unified_host_uses_v2_where_it_offers_the_controller() {
        let mounts = parse_mountinfo(UNIFIED_MOUNTINFO);
        let own = parse_membership(UNIFIED_CGROUP);
        let offers = |dir: &Path| {
            assert_eq!(
                dir,
                Path::new("/sys/fs/cgroup/system.slice/tokentap.service")
            );
            "cpu memory pids".to_owned()
        };
        let h = choose_hierarchy(&mounts, &own, "memory", offers).unwrap();
        assert!(h.v2);
        assert_eq!(
            h.own,
            Path::new("/sys/fs/cgroup/system.slice/tokentap.service")
        );
        // Not delegated to this cgroup, and no v1 hierarchy: a clear error.
        let err = choose_hierarchy(&mounts, &own, "memory", |_| String::new()).unwrap_err();
        assert!(err.to_string().contains("memory"), "{err}");
    }

    #[test]
    fn escaped_mount_points_are_decoded() {
        let m = parse_mountinfo(
            "1 2 0:1 / /mnt/with\\040space rw - cgroup2 none rw\n9 9 0:2 / /x rw - ext4 /dev/a rw\n",
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].dir, Path::new("/mnt/with space"));
    }

    #[test]
    fn this_hosts_own_cgroup_is_a_directory() {
        // Every Linux host this runs on has a v2 hierarchy (unified or hybrid).
        let own = own_cgroup().unwrap();
        assert!(own.join("cgroup.procs").exists(), "{}", own.display());
    }
}
