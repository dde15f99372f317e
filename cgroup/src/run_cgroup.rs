//! A cgroup v2 directory for one run (`tokentap run`, a sample with transparent capture):
//! made under `<cgroup2>/tokentap/`, processes put in it, and taken down (killing what is
//! left) when the run ends. Or an existing cgroup (a pod's), which is never removed.

use std::path::{Path, PathBuf};

use crate::dir;
use crate::hierarchy::{cgroup2_mount, own_cgroup};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0}")]
    NoCgroup2(std::io::Error),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("cgroup {path}: {source}")]
    TakeDown {
        path: String,
        source: std::io::Error,
    },
    #[error("refusing to capture cgroup {cgroup}: tokentap itself runs in {own}, inside it, so its own connections to the engine and the spool's receiver would be redirected back to itself. Run tokentap outside the captured cgroup (e.g. as a sibling of the pod's cgroup, or from the host's root cgroup)")]
    ContainsSelf { cgroup: String, own: String },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.display().to_string();
    move |source| CgroupError::Io { what, path, source }
}

/// Where run cgroups are made: `<cgroup2 mount>/tokentap`.
pub fn runs_parent() -> Result<PathBuf, CgroupError> {
    Ok(cgroup2_mount()
        .map_err(CgroupError::NoCgroup2)?
        .join("tokentap"))
}

/// Removes what a killed run left under `<cgroup2 mount>/tokentap`: cgroups named
/// `...-pid<PID>` whose process is gone (their processes are killed first). Returns the paths
/// removed.
pub fn remove_stale() -> Result<Vec<PathBuf>, CgroupError> {
    Ok(dir::remove_stale_children(&runs_parent()?, ""))
}

/// A run's cgroup; removed (after killing what is left in it) on drop when this process made
/// it.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
    owned: bool,
}

impl Cgroup {
    /// Makes `<cgroup2 mount>/tokentap/<name>`.
    pub fn create(name: &str) -> Result<Cgroup, CgroupError> {
        let parent = runs_parent()?;
        std::fs::create_dir_all(&parent).map_err(io("creating", &parent))?;
        let path = parent.join(name);
        std::fs::create_dir(&path).map_err(io("creating", &path))?;
        Ok(Cgroup { path, owned: true })
    }

    /// Makes `<cgroup2 mount>/tokentap/<name>-pid<PID>`: named after this process, so that
    /// [`remove_stale`] at a later start can take it down if this process is killed.
    pub fn create_for_this_process(name: &str) -> Result<Cgroup, CgroupError> {
        Cgroup::create(&dir::name_for_this_process(name))
    }

    /// An existing cgroup (a pod's), never removed by this process.
    pub fn existing(path: &Path) -> Result<Cgroup, CgroupError> {
        let procs = path.join("cgroup.procs");
        std::fs::metadata(&procs).map_err(io("opening", &procs))?;
        Ok(Cgroup {
            path: path.to_owned(),
            owned: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fails when this process is in this cgroup or one below it: a redirect attached here
    /// would catch tokentap's own connections.
    pub fn ensure_outside(&self) -> Result<(), CgroupError> {
        let own = own_cgroup().map_err(CgroupError::NoCgroup2)?;
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
        if canon(&own).starts_with(canon(&self.path)) {
            return Err(CgroupError::ContainsSelf {
                cgroup: self.path.display().to_string(),
                own: own.display().to_string(),
            });
        }
        Ok(())
    }

    /// Its `cgroup.procs` file.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Processes in this cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        dir::pids(&self.path)
    }

    /// Kills every process in the cgroup and removes the directory once it is empty.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.take_down()
    }

    fn take_down(&mut self) -> Result<(), CgroupError> {
        if !self.owned {
            return Ok(());
        }
        self.owned = false;
        dir::take_down(&self.path, dir::TAKE_DOWN_TIMEOUT).map_err(|source| CgroupError::TakeDown {
            path: self.path.display().to_string(),
            source,
        })
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.take_down() {
            tracing::warn!(error = %e, "could not remove the run's cgroup");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_is_made_filled_emptied_and_removed() {
        if !tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2()) {
            return;
        }
        let cg = Cgroup::create(&format!("unit-{}", std::process::id())).unwrap();
        let path = cg.path().to_owned();
        assert!(path.join("cgroup.procs").exists());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        std::fs::write(cg.procs_file(), child.id().to_string()).unwrap();
        assert_eq!(cg.pids(), vec![child.id()]);
        cg.remove().unwrap();
        assert!(!path.exists());
        // The process was killed with the cgroup.
        let status = child.wait().unwrap();
        assert!(!status.success());
    }

    #[test]
    fn a_pods_cgroup_is_never_removed() {
        if !tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2()) {
            return;
        }
        let made = Cgroup::create_for_this_process("unit-existing").unwrap();
        let existing = Cgroup::existing(made.path()).unwrap();
        drop(existing);
        assert!(made.path().exists(), "an existing cgroup stays");
        assert!(
            Cgroup::existing(&made.path().join("absent")).is_err(),
            "a missing cgroup is an error"
        );
        // This process sits outside a cgroup it made, but inside its own.
        made.ensure_outside().unwrap();
        let own = Cgroup::existing(&own_cgroup().unwrap()).unwrap();
        assert!(matches!(
            own.ensure_outside(),
            Err(CgroupError::ContainsSelf { .. })
        ));
    }
}
