//! Working copies. A rollout's workspace is exported once into a snapshot (`original/`): a
//! directory copied, or a git repository's commit exported with `git archive`, so no history
//! (and no future commit) comes along. The snapshot is then a one-commit repository of its
//! own, so agents that like `git diff` have it. Each sample copies the snapshot into its own
//! `work/`; evaluation runs in yet another fresh copy of the final `work/`, without `.git`,
//! with the task's test files restored from the snapshot.

use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::process::Command;

use crate::sample_files::create_fresh;
use crate::sandbox::{Mounts, TaskJail};
use crate::task::Workspace;

/// The rollout's snapshot under `rollout_dir`, made on first use (concurrent samples of the
/// same rollout race safely: each builds a private copy and the first rename wins).
pub async fn snapshot(workspace: &Workspace, rollout_dir: &Path) -> anyhow::Result<PathBuf> {
    let original = rollout_dir.join("original");
    if original.exists() {
        return Ok(original);
    }
    tokio::fs::create_dir_all(rollout_dir).await?;
    let building = rollout_dir.join(format!("original.{}", uuid::Uuid::now_v7().simple()));
    let result = export(workspace, &building).await;
    if let Err(e) = result {
        let _ = tokio::fs::remove_dir_all(&building).await;
        return Err(e);
    }
    if tokio::fs::rename(&building, &original).await.is_err() {
        // Another sample's snapshot got there first; it is the same export.
        let _ = tokio::fs::remove_dir_all(&building).await;
    }
    Ok(original)
}

async fn export(workspace: &Workspace, to: &Path) -> anyhow::Result<()> {
    match workspace {
        Workspace::Dir { path, .. } => {
            copy_tree(Path::new(path), to).await?;
            // A directory's own history could hold the answer (later commits).
            let git = to.join(".git");
            if git.exists() {
                tokio::fs::remove_dir_all(&git).await?;
            }
        }
        Workspace::Git { url, commit, .. } => {
            check_rev(commit)?;
            let clone = to.with_extension("clone");
            // `--` keeps a url like `--upload-pack=...` a url; no `ext::` command transport.
            run(
                Command::new("git")
                    .args(["-c", "protocol.ext.allow=never"])
                    .args(["clone", "--quiet", "--no-checkout", "--", url])
                    .arg(&clone),
                "git clone",
            )
            .await?;
            tokio::fs::create_dir_all(to).await?;
            let tar = to.with_extension("tar");
            let r = async {
                run(
                    Command::new("git")
                        .arg("-C")
                        .arg(&clone)
                        .args(["archive", "--format=tar", "-o"])
                        .arg(&tar)
                        .args([commit.as_str(), "--"]),
                    "git archive",
                )
                .await?;
                run(
                    Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(to),
                    "tar -x",
                )
                .await
            }
            .await;
            let _ = tokio::fs::remove_file(&tar).await;
            let _ = tokio::fs::remove_dir_all(&clone).await;
            r.with_context(|| format!("exporting commit {commit} of {url}"))?;
        }
    }
    // One commit, no history: `git diff` works for the agent, nothing else is in there.
    let init = "git init -q && git add -A && git -c user.name=tokentap -c user.email=tokentap@localhost commit -q --allow-empty -m task";
    if let Err(e) = run(
        Command::new("sh").args(["-c", init]).current_dir(to),
        "git init",
    )
    .await
    {
        tracing::warn!(error = %e, "the workspace snapshot is not a git repository");
        let _ = tokio::fs::remove_dir_all(to.join(".git")).await;
    }
    Ok(())
}

/// `commit` as git may take it: a revision, never an option.
pub fn check_rev(commit: &str) -> anyhow::Result<()> {
    let ok = !commit.is_empty()
        && commit.len() <= 256
        && !commit.starts_with('-')
        && commit
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/~^@{}-".contains(&b));
    if !ok {
        bail!("commit `{commit}` is not a git revision (a hash, branch or tag name)");
    }
    Ok(())
}

/// Where a sample's set-up runs: its directories, its log, and the jail it runs in.
pub struct SetupPaths<'a> {
    /// The working copy (made here).
    pub work: &'a Path,
    /// Its HOME and TMPDIR, made before.
    pub home: &'a Path,
    pub tmp: &'a Path,
    pub log: &'a Path,
}

/// A sample's working copy of the snapshot, handed to the sandbox uid, with the task's set-up
/// command run in it, confined by `jail` (as the agent will be).
pub async fn working_copy(
    original: &Path,
    paths: &SetupPaths<'_>,
    setup: Option<&str>,
    jail: &TaskJail,
    budget: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + budget;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    let work = paths.work;
    if work.exists() {
        tokio::fs::remove_dir_all(work).await?;
    }
    copy_for_sample(jail, original, work, left()).await?;
    jail.give(&[work, paths.home, paths.tmp], left()).await?;
    let Some(setup) = setup else {
        return Ok(());
    };
    let out = create_fresh(paths.log)?;
    let mounts = Mounts {
        writable: vec![work.to_owned(), paths.home.to_owned(), paths.tmp.to_owned()],
        ..Mounts::default()
    };
    let env = [
        ("HOME", paths.home.as_os_str()),
        ("TMPDIR", paths.tmp.as_os_str()),
    ];
    let mut confined = jail.shell("init", setup, work, &env, &mounts)?;
    let mut child = confined
        .cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let status = match tokio::time::timeout(left(), child.wait()).await {
        Ok(s) => Some(s?),
        Err(_) => None,
    };
    if let Some(pgid) = child.id() {
        // SAFETY: kill(2) on the process group the set-up led.
        unsafe { libc::kill(-(pgid as i32), libc::SIGKILL) };
    }
    let _ = child.wait().await;
    if let Some(cg) = &confined.cgroup {
        cg.kill_all();
    }
    confined.check_started(paths.log)?;
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => bail!("set-up `{setup}` failed ({s}); see {}", paths.log.display()),
        None => bail!(
            "set-up `{setup}` ran over the {} s budget; see {}",
            budget.as_secs(),
            paths.log.display()
        ),
    }
}

/// A fresh copy of the final `work` at `dest` for evaluation: no `.git`, and each of
/// `test_files` put back as it is in `original` (or removed when the task had none there), so
/// an agent that edited or added tests gains nothing. The copies run for the sample (see
/// [`copy_for_sample`]), within `budget`.
pub async fn evaluation_copy(
    work: &Path,
    original: &Path,
    test_files: &[String],
    dest: &Path,
    jail: &TaskJail,
    budget: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + budget;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    if dest.exists() {
        tokio::fs::remove_dir_all(dest).await?;
    }
    copy_for_sample(jail, work, dest, left()).await?;
    let git = dest.join(".git");
    if git.exists() {
        tokio::fs::remove_dir_all(&git).await?;
    }
    for rel in test_files {
        let rel = relative(rel)?;
        refuse_links_above(dest, rel).await?;
        let (from, to) = (original.join(rel), dest.join(rel));
        match tokio::fs::symlink_metadata(&to).await {
            Ok(m) if m.is_dir() => tokio::fs::remove_dir_all(&to).await?,
            Ok(_) => tokio::fs::remove_file(&to).await?,
            Err(_) => {}
        }
        if from.exists() {
            if let Some(parent) = to.parent() {
                tokio::fs::create_dir_all(parent).await?;
            }
            copy_for_sample(jail, &from, &to, left()).await?;
        }
    }
    Ok(())
}

/// Fails when a directory on the way from `root` to `rel` (not `rel` itself, which is
/// replaced) is a link: restoring through it would write outside the copy (an agent that made
/// `tests` a link to /etc or to another sample's directory).
async fn refuse_links_above(root: &Path, rel: &Path) -> anyhow::Result<()> {
    let mut at = root.to_owned();
    let parents: Vec<Component> = rel.components().collect();
    for c in &parents[..parents.len().saturating_sub(1)] {
        at.push(c);
        match tokio::fs::symlink_metadata(&at).await {
            Ok(m) if m.file_type().is_symlink() => bail!(
                "test file `{}`: `{}` in the final workspace is a link; refusing to restore through it",
                rel.display(),
                at.strip_prefix(root).unwrap_or(&at).display()
            ),
            Ok(m) if !m.is_dir() => bail!(
                "test file `{}`: `{}` in the final workspace is not a directory",
                rel.display(),
                at.strip_prefix(root).unwrap_or(&at).display()
            ),
            Ok(_) => {}
            Err(_) => return Ok(()), // missing from here on: made fresh below
        }
    }
    Ok(())
}

/// `rel` as a path inside the workspace; absolute paths and `..` are refused.
pub fn relative(rel: &str) -> anyhow::Result<&Path> {
    let p = Path::new(rel);
    if rel.is_empty()
        || p.components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        bail!("test file `{rel}` must be a relative path inside the workspace");
    }
    Ok(p)
}

/// `cp -a from to` for a sample (a tree it wrote, or one it gets): in its cgroup, within
/// `budget` ([`TaskJail::run_for_sample`]).
pub async fn copy_for_sample(
    jail: &TaskJail,
    from: &Path,
    to: &Path,
    budget: Duration,
) -> anyhow::Result<()> {
    let mut cp = Command::new("cp");
    cp.arg("-a").arg("--").arg(from).arg(to);
    jail.run_for_sample(cp, "cp -a", budget)
        .await
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

/// `cp -a from to` (keeps modes, links and times; `to` must not exist).
pub async fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    run(Command::new("cp").arg("-a").arg(from).arg(to), "cp -a")
        .await
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))
}

async fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd.stdin(Stdio::null()).output().await?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    }

    /// A jail that confines nothing (no sandbox, no limits).
    fn unconfined() -> TaskJail {
        TaskJail {
            sandbox: None,
            limits: tokentap_cgroup::Limits::default(),
            path: "/usr/bin:/bin".into(),
            name: "workspace-test".into(),
        }
    }

    /// A sample's copy runs in a cgroup of the sample's limits and ends at its budget.
    /// Positive control: the same command with time to spare succeeds.
    #[tokio::test]
    async fn a_copy_for_a_sample_runs_in_its_cgroup_within_its_budget() {
        if !tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2()) {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let seen = dir.path().join("cgroup");
        let jail = TaskJail {
            limits: tokentap_cgroup::Limits {
                pids: Some(64),
                ..Default::default()
            },
            ..unconfined()
        };
        let cmd = |sleep: &str| {
            let mut c = Command::new("sh");
            c.arg("-c").arg(format!(
                "cat /proc/self/cgroup > {}; sleep {sleep}",
                seen.display()
            ));
            c
        };
        jail.run_for_sample(cmd("0"), "probe", Duration::from_secs(20))
            .await
            .unwrap();
        let cgroups = std::fs::read_to_string(&seen).unwrap();
        assert!(cgroups.contains("workspace-test-node"), "{cgroups}");
        let started = std::time::Instant::now();
        let e = jail
            .run_for_sample(cmd("30"), "probe", Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("ran over"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[tokio::test]
    async fn a_git_workspace_is_exported_at_its_commit_without_history() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        write(&repo.join("a.txt"), "first");
        let git = |args: &str| {
            let ok = std::process::Command::new("sh")
                .args([
                    "-c",
                    &format!("git -c user.name=t -c user.email=t@t {args}"),
                ])
                .current_dir(&repo)
                .status()
                .unwrap()
                .success();
            assert!(ok, "git {args}");
        };
        git("init -q");
        git("add -A");
        git("commit -q -m one");
        let first = String::from_utf8(
            std::process::Command::new("git")
                .args(["rev-parse", "HEAD"])
                .current_dir(&repo)
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        write(&repo.join("a.txt"), "the answer, from the future");
        git("commit -q -am two");

        let ws = Workspace::Git {
            url: repo.display().to_string(),
            commit: first.trim().to_owned(),
            setup: None,
        };
        let original = snapshot(&ws, &dir.path().join("rollout")).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(original.join("a.txt")).unwrap(),
            "first"
        );
        let log = std::process::Command::new("git")
            .args(["log", "--all", "--format=%s"])
            .current_dir(&original)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&log.stdout).trim(), "task");
    }

    #[tokio::test]
    async fn the_evaluation_copy_restores_test_files_and_drops_git() {
        let dir = tempfile::tempdir().unwrap();
        let (original, work, eval) = (
            dir.path().join("original"),
            dir.path().join("work"),
            dir.path().join("eval"),
        );
        write(&original.join("tests/test_x.py"), "real test");
        write(&original.join("x.py"), "bug");
        write(&work.join("tests/test_x.py"), "assert True");
        write(&work.join("tests/conftest.py"), "cheat");
        write(&work.join("x.py"), "fix");
        write(&work.join(".git/HEAD"), "ref");
        evaluation_copy(
            &work,
            &original,
            &["tests/test_x.py".into(), "tests/conftest.py".into()],
            &eval,
            &unconfined(),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        let read = |p: &str| std::fs::read_to_string(eval.join(p)).ok();
        assert_eq!(read("tests/test_x.py").as_deref(), Some("real test"));
        assert_eq!(read("tests/conftest.py"), None, "added by the agent");
        assert_eq!(read("x.py").as_deref(), Some("fix"));
        assert!(!eval.join(".git").exists());
    }

    #[tokio::test]
    async fn the_evaluation_copy_refuses_to_restore_through_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let (original, work, eval, outside) = (
            dir.path().join("original"),
            dir.path().join("work"),
            dir.path().join("eval"),
            dir.path().join("other-sample"),
        );
        write(&original.join("tests/test_x.py"), "real test");
        write(&outside.join("test_x.py"), "another sample's file");
        std::fs::create_dir_all(&work).unwrap();
        std::os::unix::fs::symlink(&outside, work.join("tests")).unwrap();
        let e = evaluation_copy(
            &work,
            &original,
            &["tests/test_x.py".into()],
            &eval,
            &unconfined(),
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("is a link"), "{e}");
        assert_eq!(
            std::fs::read_to_string(outside.join("test_x.py")).unwrap(),
            "another sample's file",
            "nothing written or removed outside the copy"
        );
    }

    #[tokio::test]
    async fn git_options_in_a_url_or_commit_are_inert() {
        let dir = tempfile::tempdir().unwrap();
        let pwned = dir.path().join("pwned");
        let url = format!("--upload-pack=touch {}", pwned.display());
        let ws = Workspace::Git {
            url,
            commit: "HEAD".into(),
            setup: None,
        };
        assert!(snapshot(&ws, &dir.path().join("r1")).await.is_err());
        assert!(!pwned.exists(), "the url reached git as an option");
        for commit in [
            format!("--output={}", pwned.display()),
            "".into(),
            "a b".into(),
        ] {
            let ws = Workspace::Git {
                url: dir.path().display().to_string(),
                commit: commit.clone(),
                setup: None,
            };
            let e = snapshot(&ws, &dir.path().join("r2")).await.unwrap_err();
            assert!(
                e.to_string().contains("not a git revision"),
                "{commit}: {e}"
            );
        }
        assert!(!pwned.exists());
        assert!(check_rev("HEAD~1").is_ok() && check_rev("v1.2/x").is_ok());
    }

    #[test]
    fn test_files_must_stay_inside_the_workspace() {
        for bad in ["/etc/passwd", "../x", "a/../../x", ""] {
            assert!(relative(bad).is_err(), "{bad}");
        }
        assert!(relative("tests/test_a.py").is_ok());
    }
}
