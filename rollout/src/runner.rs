//! Which programs an evaluation command runs: decided by the node, never by the agent's tree.
//!
//! An evaluation runs in a copy of the tree the agent wrote, so anything the command finds
//! *relative to its working directory* is the agent's: `python3 -m unittest` imports a planted
//! `unittest/__main__.py` first (the working directory is `sys.path[0]`), `-m pytest` a planted
//! `pytest.py`, pytest loads any `conftest.py` and reads `pytest.ini`, `sh run_tests.sh` runs
//! whatever the agent left in `run_tests.sh`, a pyenv shim picks the interpreter named by a
//! planted `.python-version`. The node therefore analyses each command at submission
//! ([`analyse`]) and, at evaluation, runs it rewritten ([`Pinned::render`]):
//!
//! - every program is resolved to an absolute path by the node, on the node's harness path
//!   (absolute entries only), pyenv shims resolved through `pyenv which` from `/`;
//! - every Python runner (`python… -m MODULE`, `python… SCRIPT`, `python… -c CODE`) runs
//!   isolated (`-I`: no working directory, script directory, `PYTHON*` variables or user
//!   site on `sys.path`) through a bootstrap that appends the tree to the *end* of `sys.path`
//!   (after the standard library and the installed packages), so the tests still import the
//!   agent's code but nothing of the tree can stand in for the runner or its imports;
//! - pytest (`pytest`, `python -m pytest`) gets `-p no:cacheprovider`, its configuration only
//!   from the task's `test_files` (`-c` the listed `pytest.ini`/`pyproject.toml`/`tox.ini`/
//!   `setup.cfg`, else `/dev/null`) and `--rootdir` the evaluation copy, and the evaluation
//!   copy keeps only the `conftest.py` files `test_files` restored (see `evaluate`); for
//!   `python -m pytest` the tree joins `sys.path` (last) once pytest's plugins are loaded;
//! - a command that runs a file of the tree (`sh run_tests.sh`, `./test.sh`, `python3
//!   run.py`, `make` without its `Makefile` restored, …) is refused unless that file is one of
//!   `test_files` (restored from the original before the command runs).
//!
//! The node analyses simple commands joined by `&&`, `||`, `;` and newlines, with quoting.
//! Other shell syntax (pipes, redirections, variables, substitutions, globs, `sh -c`) is run
//! as written and the sample's evaluation says so (`shadowable`).

use std::path::{Component, Path, PathBuf};

/// The placeholder a `swebench` test command is analysed with at submission.
pub const SOME_TEST_ID: &str = "tests/test_some.py::test_some";

/// What the node makes of an evaluation command.
#[derive(Debug, Clone, PartialEq)]
pub enum Analysis {
    /// Every program it runs is the node's choice: run as [`Pinned::render`] writes it.
    Pinned(Pinned),
    /// Shell syntax the node does not analyse: run as written; why (shown on the sample).
    Unanalysed(String),
}

/// A command list the node rewrites: its simple commands and the operators between them.
#[derive(Debug, Clone, PartialEq)]
pub struct Pinned {
    commands: Vec<Vec<Part>>,
    ops: Vec<&'static str>,
}

/// One word of a rewritten simple command.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    /// As written.
    Word(String),
    /// A program name the node resolves on its own path.
    Program(String),
    /// The pytest configuration the node pins (a listed config file or /dev/null).
    PytestConfig,
    /// The evaluation copy's root (absolute).
    Root,
}

/// The Python the rewritten runners start: `-I` and this bootstrap, then its mode
/// (`m`, `pytest`, `script`, `code`), its target and the command's own arguments.
pub const PYTHON_BOOTSTRAP: &str = r#"import os, sys
mode, target = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
here = os.getcwd()
if mode == "pytest":
    import pytest
    class _TreeLast:
        def pytest_sessionstart(self, session):
            if here not in sys.path:
                sys.path.append(here)
    raise SystemExit(int(pytest.main(sys.argv[1:], plugins=[_TreeLast()])))
import runpy
if mode == "m":
    sys.path.append(here)
    sys.argv[0] = target
    runpy.run_module(target, run_name="__main__", alter_sys=True)
elif mode == "script":
    sys.path.append(os.path.dirname(os.path.abspath(target)))
    sys.argv[0] = target
    runpy.run_path(target, run_name="__main__")
else:
    sys.path.append(here)
    sys.argv[0] = "-c"
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"#;

/// Shell builtins run as written (a builtin cannot be shadowed by a file).
const BUILTINS: &[&str] = &[
    "true", "false", ":", "test", "[", "echo", "printf", "exit", "cd",
];

/// Builtins that change what later commands are or run a file: not analysed.
const OPAQUE_BUILTINS: &[&str] = &[
    "export", "set", "unset", "alias", "eval", "exec", "env", "command", "builtin", "trap", "sudo",
    "xargs", "nohup", "nice", "busybox",
];

/// Shells and interpreters whose first operand is a script to run.
const INTERPRETERS: &[&str] = &[
    "sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "node", "nodejs", "deno", "perl", "ruby",
    "php", "lua", "Rscript", "tclsh", "source", ".",
];

/// Task runners and the recipe files (read from the working directory) that decide what they
/// run: refused unless one of them is restored by `test_files`.
const RECIPES: &[(&str, &[&str])] = &[
    ("make", &["Makefile", "makefile", "GNUmakefile"]),
    ("gmake", &["Makefile", "makefile", "GNUmakefile"]),
    ("npm", &["package.json"]),
    ("yarn", &["package.json"]),
    ("pnpm", &["package.json"]),
    ("bun", &["package.json"]),
    ("tox", &["tox.ini", "pyproject.toml", "setup.cfg"]),
    ("nox", &["noxfile.py"]),
    ("just", &["justfile", "Justfile", ".justfile"]),
    ("rake", &["Rakefile", "rakefile"]),
    ("invoke", &["tasks.py"]),
    ("mvn", &["pom.xml"]),
    ("gradle", &["build.gradle", "build.gradle.kts"]),
];

/// pytest's configuration files, in the order pytest itself prefers them.
const PYTEST_CONFIGS: &[&str] = &[
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
];

/// Analyses `command` (a task's evaluation command). `Err`: it plainly runs something of
/// the agent's tree (refused at submission, with the reason).
pub fn analyse(command: &str, test_files: &[String]) -> Result<Analysis, String> {
    let tokens = match tokenize(command) {
        Ok(t) => t,
        Err(why) => return Ok(Analysis::Unanalysed(why)),
    };
    let mut commands = Vec::new();
    let mut ops = Vec::new();
    let mut current: Vec<String> = Vec::new();
    for t in tokens {
        match t {
            Tok::Word(w) => current.push(w),
            Tok::Op(op) => {
                if current.is_empty() {
                    if op == ";" && ops.last().is_none_or(|o| *o == ";") {
                        continue; // blank lines and stray `;`
                    }
                    return Ok(Analysis::Unanalysed(format!(
                        "an empty command before `{op}`"
                    )));
                }
                commands.push(std::mem::take(&mut current));
                ops.push(op);
            }
        }
    }
    if current.is_empty() {
        if ops.last().is_some_and(|o| *o != ";") {
            return Ok(Analysis::Unanalysed(
                "a command list that ends in an operator".into(),
            ));
        }
        ops.pop();
    } else {
        commands.push(current);
    }
    if commands.is_empty() {
        return Ok(Analysis::Unanalysed("an empty command".into()));
    }
    let mut dir = Some(PathBuf::new());
    let mut pinned = Vec::new();
    for words in &commands {
        match classify(words, test_files, &mut dir)? {
            Some(parts) => pinned.push(parts),
            None => {
                return Ok(Analysis::Unanalysed(format!(
                    "`{}` is not a form the node analyses",
                    words.join(" ")
                )))
            }
        }
    }
    Ok(Analysis::Pinned(Pinned {
        commands: pinned,
        ops,
    }))
}

/// Whether `analysis` runs pytest (its evaluation copy then keeps only restored conftests).
pub fn runs_pytest(analysis: &Analysis) -> bool {
    match analysis {
        Analysis::Pinned(p) => p.commands.iter().any(|c| c.contains(&Part::PytestConfig)),
        Analysis::Unanalysed(_) => false,
    }
}

/// The pytest configuration a task's evaluation uses: the first of pytest's configuration
/// files that `test_files` restores at the tree's root, else none (`/dev/null`).
pub fn pytest_config(test_files: &[String]) -> Option<&'static str> {
    PYTEST_CONFIGS.iter().copied().find(|c| {
        test_files
            .iter()
            .any(|t| normal(t) == Some(PathBuf::from(c)))
    })
}

/// Whether `rel` (relative to the tree's root) is one of `test_files` or lies under one.
pub fn restored(rel: &Path, test_files: &[String]) -> bool {
    test_files
        .iter()
        .filter_map(|t| normal(t))
        .any(|t| rel.starts_with(&t))
}

/// `p` without `.` components; None when it is absolute or climbs out with `..`.
fn normal(p: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in Path::new(p).components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            _ => return None,
        }
    }
    Some(out)
}

/// One simple command's parts; None: not a form the node analyses; Err: refused. `dir` is
/// where a `cd` left the command, relative to the tree's root (None: unknown).
fn classify(
    words: &[String],
    test_files: &[String],
    dir: &mut Option<PathBuf>,
) -> Result<Option<Vec<Part>>, String> {
    let w = |s: &str| Part::Word(s.to_owned());
    let program = words[0].as_str();
    let args = &words[1..];
    // A file of the tree, relative to where the command is: restored, or refused.
    let tree_file = |rel: &str, why: &str| -> Result<(), String> {
        let restored_here = dir
            .as_ref()
            .and_then(|d| normal(&d.join(rel).to_string_lossy()))
            .is_some_and(|p| restored(&p, test_files));
        if restored_here {
            Ok(())
        } else {
            Err(format!(
                "the evaluation command {why} `{rel}` from the agent's tree (the working copy the agent wrote); list it in test_files so the original is restored before the command runs, or run the tests with a runner the node pins (`python3 -m unittest`, `python3 -m pytest`, `pytest`): docs/security.md, \"Rewards the agent's tree cannot shadow\""
            ))
        }
    };
    if program.contains('=') {
        return Ok(None); // an assignment (NAME=value cmd)
    }
    if program == "cd" {
        *dir = match (args, dir.as_ref()) {
            ([to], Some(d)) if !to.starts_with('-') && !Path::new(to).is_absolute() => {
                normal(&d.join(to).to_string_lossy())
            }
            _ => None,
        };
        return Ok(Some(words.iter().map(|s| w(s)).collect()));
    }
    if BUILTINS.contains(&program) {
        return Ok(Some(words.iter().map(|s| w(s)).collect()));
    }
    if program.contains('/') {
        if Path::new(program).is_absolute() {
            return Ok(Some(words.iter().map(|s| w(s)).collect()));
        }
        tree_file(program, "runs")?;
        return Ok(Some(words.iter().map(|s| w(s)).collect()));
    }
    if program == "timeout" {
        // timeout [-k D] [-s SIG] [--foreground] [--preserve-status] DURATION COMMAND…
        let mut i = 0;
        while i < args.len() && args[i].starts_with('-') {
            i += if matches!(args[i].as_str(), "-k" | "-s") {
                2
            } else {
                1
            };
        }
        if i + 1 >= args.len() {
            return Ok(None);
        }
        let Some(rest) = classify(&args[i + 1..], test_files, dir)? else {
            return Ok(None);
        };
        let mut parts = vec![Part::Program("timeout".into())];
        parts.extend(args[..=i].iter().map(|s| w(s)));
        parts.extend(rest);
        return Ok(Some(parts));
    }
    if is_python(program) {
        return python(program, args, &tree_file);
    }
    if matches!(program, "pytest" | "py.test") {
        let mut parts = vec![Part::Program(program.into())];
        parts.extend(pytest_pins());
        parts.extend(args.iter().map(|s| w(s)));
        return Ok(Some(parts));
    }
    if INTERPRETERS.contains(&program) {
        if has_inline(args) {
            return Ok(None); // inline code the node does not analyse (`sh -c '…'`)
        }
        match args.iter().find(|a| !a.starts_with('-')) {
            Some(script) if !Path::new(script).is_absolute() => tree_file(script, "runs")?,
            Some(_) => {}
            None => return Ok(None),
        }
        if matches!(program, "source" | ".") {
            return Ok(Some(words.iter().map(|s| w(s)).collect()));
        }
        let mut parts = vec![Part::Program(program.into())];
        parts.extend(args.iter().map(|s| w(s)));
        return Ok(Some(parts));
    }
    if OPAQUE_BUILTINS.contains(&program) {
        return Ok(None);
    }
    if let Some((_, recipes)) = RECIPES.iter().find(|(p, _)| *p == program) {
        let listed = test_files.iter().any(|t| {
            Path::new(t)
                .file_name()
                .is_some_and(|n| recipes.iter().any(|r| n == *r))
        });
        if !listed {
            return Err(format!(
                "the evaluation command runs `{program}`, which does what `{}` in the agent's tree (the working copy the agent wrote) says; list it in test_files so the original is restored before the command runs: docs/security.md, \"Rewards the agent's tree cannot shadow\"",
                recipes[0]
            ));
        }
    }
    let mut parts = vec![Part::Program(program.into())];
    parts.extend(args.iter().map(|s| w(s)));
    Ok(Some(parts))
}

/// Inline code (`-c`, `-e`, `--eval`) rather than a script.
fn has_inline(args: &[String]) -> bool {
    args.iter()
        .take_while(|a| a.starts_with('-'))
        .any(|a| matches!(a.as_str(), "-c" | "-e" | "-E" | "--eval" | "-lc" | "-ec"))
}

/// `python`, `python3`, `python3.12`, `pypy3`.
fn is_python(p: &str) -> bool {
    let rest = p.strip_prefix("python").or_else(|| p.strip_prefix("pypy"));
    rest.is_some_and(|r| r.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

/// What the node adds to every pytest run.
fn pytest_pins() -> Vec<Part> {
    vec![
        Part::Word("-p".into()),
        Part::Word("no:cacheprovider".into()),
        Part::Word("-c".into()),
        Part::PytestConfig,
        Part::Word("--rootdir".into()),
        Part::Root,
    ]
}

/// A Python command, rewritten to run isolated through [`PYTHON_BOOTSTRAP`].
fn python(
    program: &str,
    args: &[String],
    tree_file: &dyn Fn(&str, &str) -> Result<(), String>,
) -> Result<Option<Vec<Part>>, String> {
    let w = |s: &str| Part::Word(s.to_owned());
    let mut opts: Vec<Part> = Vec::new();
    let mut i = 0;
    // The interpreter's options, up to the module, code or script.
    let (mode, target, rest) = loop {
        let Some(a) = args.get(i) else {
            return Ok(None); // the interactive interpreter (stdin)
        };
        i += 1;
        if a == "-" || a.starts_with("--") {
            return Ok(None);
        }
        let Some(flags) = a.strip_prefix('-') else {
            tree_file(a, "runs the Python script")?;
            break ("script", a.clone(), &args[i..]);
        };
        let mut found = None;
        for (at, c) in flags.char_indices() {
            match c {
                'b' | 'B' | 'd' | 'E' | 'i' | 'I' | 'O' | 'P' | 'q' | 's' | 'S' | 'u' | 'v'
                | 'x' => opts.push(w(&format!("-{c}"))),
                'W' | 'X' | 'm' | 'c' => {
                    let inline = &flags[at + 1..];
                    let value = if inline.is_empty() {
                        let Some(v) = args.get(i) else {
                            return Ok(None);
                        };
                        i += 1;
                        v.clone()
                    } else {
                        inline.to_owned()
                    };
                    match c {
                        'm' | 'c' => found = Some((c, value)),
                        _ => {
                            opts.push(w(&format!("-{c}")));
                            opts.push(w(&value));
                        }
                    }
                    break;
                }
                _ => return Ok(None),
            }
        }
        match found {
            Some(('m', module)) if matches!(module.as_str(), "pytest" | "py.test") => {
                break ("pytest", module, &args[i..]);
            }
            Some(('m', module)) => break ("m", module, &args[i..]),
            Some((_, code)) => break ("code", code, &args[i..]),
            None => {}
        }
    };
    let mut parts = vec![Part::Program(program.into()), w("-I")];
    parts.extend(opts);
    parts.extend([w("-c"), w(PYTHON_BOOTSTRAP), w(mode), w(&target)]);
    if mode == "pytest" {
        parts.extend(pytest_pins());
    }
    parts.extend(rest.iter().map(|s| w(s)));
    Ok(Some(parts))
}

impl Pinned {
    /// The command as the node runs it (a `sh -c` script): every program as `resolve` names
    /// it (an absolute path; a name it cannot resolve is left as written, and fails as it
    /// would have), pytest's configuration `config` (absolute), `root` the evaluation copy.
    pub fn render(
        &self,
        resolve: &dyn Fn(&str) -> Option<PathBuf>,
        config: &Path,
        root: &Path,
    ) -> String {
        let mut out = String::new();
        for (i, parts) in self.commands.iter().enumerate() {
            if i > 0 {
                out.push(' ');
                out.push_str(self.ops[i - 1]);
                out.push(' ');
            }
            let words: Vec<String> = parts
                .iter()
                .map(|p| match p {
                    Part::Word(w) => quote(w),
                    Part::Program(name) => match resolve(name) {
                        Some(abs) => quote(&abs.to_string_lossy()),
                        None => quote(name),
                    },
                    Part::PytestConfig => quote(&config.to_string_lossy()),
                    Part::Root => quote(&root.to_string_lossy()),
                })
                .collect();
            out.push_str(&words.join(" "));
        }
        out
    }

    /// The program names it runs (for the node to resolve).
    pub fn programs(&self) -> impl Iterator<Item = &str> {
        self.commands.iter().flatten().filter_map(|p| match p {
            Part::Program(n) => Some(n.as_str()),
            _ => None,
        })
    }
}

/// `s` as one shell word.
pub fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@%+,".contains(c))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[derive(Debug, PartialEq)]
enum Tok {
    Word(String),
    Op(&'static str),
}

/// Words and list operators; Err (why) at shell syntax the node does not analyse.
fn tokenize(s: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = s.chars().peekable();
    let unsupported = |c: char| Err(format!("the shell syntax `{c}`"));
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if let Some(w) = word.take() {
                    out.push(Tok::Word(w));
                }
            }
            '\n' | ';' | '&' | '|' => {
                if let Some(w) = word.take() {
                    out.push(Tok::Word(w));
                }
                let op = match (c, chars.peek()) {
                    ('&', Some('&')) => "&&",
                    ('|', Some('|')) => "||",
                    ('\n' | ';', _) => ";",
                    _ => return unsupported(c),
                };
                if op.len() == 2 {
                    chars.next();
                }
                out.push(Tok::Op(op));
            }
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("an unterminated quote".into()),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\')) => w.push(c),
                            Some(c @ ('$' | '`')) => return unsupported(c),
                            Some('\n') => {}
                            Some(c) => {
                                w.push('\\');
                                w.push(c);
                            }
                            None => return Err("an unterminated quote".into()),
                        },
                        Some(c @ ('$' | '`')) => return unsupported(c),
                        Some(c) => w.push(c),
                        None => return Err("an unterminated quote".into()),
                    }
                }
            }
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(c) => word.get_or_insert_with(String::new).push(c),
                None => return Err("a trailing backslash".into()),
            },
            '#' | '~' | '!' if word.is_none() => return unsupported(c),
            '<' | '>' | '(' | ')' | '`' | '$' | '*' | '?' | '{' | '}' => return unsupported(c),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    if let Some(w) = word {
        out.push(Tok::Word(w));
    }
    Ok(out)
}

/// Resolves program names on the node's path, as the node (never the sandbox, never the
/// tree) sees it: absolute entries only; a pyenv shim through `pyenv which NAME` run from `/`
/// (a shim would otherwise pick the interpreter a planted `.python-version` names).
pub struct Resolver {
    path: String,
    found: std::collections::HashMap<String, Option<PathBuf>>,
}

impl Resolver {
    pub fn new(path: &str) -> Resolver {
        Resolver {
            path: absolute_entries(path),
            found: Default::default(),
        }
    }

    /// Resolves every program of `pinned` (each once).
    pub async fn resolve_all(&mut self, pinned: &Pinned) {
        let names: Vec<String> = pinned.programs().map(str::to_owned).collect();
        for name in names {
            if !self.found.contains_key(&name) {
                let abs = self.resolve(&name).await;
                self.found.insert(name, abs);
            }
        }
    }

    /// What [`Resolver::resolve_all`] found for `name`.
    pub fn get(&self, name: &str) -> Option<PathBuf> {
        self.found.get(name).cloned().flatten()
    }

    async fn resolve(&self, name: &str) -> Option<PathBuf> {
        let found = on_path(name, &self.path)?;
        let dir = found.parent()?;
        if dir.file_name() != Some(std::ffi::OsStr::new("shims")) {
            return Some(found);
        }
        let root = dir.parent()?;
        let pyenv = [root.join("libexec/pyenv"), root.join("bin/pyenv")]
            .into_iter()
            .find(|p| p.exists());
        let Some(pyenv) = pyenv else {
            return Some(found);
        };
        let which = tokio::process::Command::new(pyenv)
            .args(["which", name])
            .env_clear()
            .env("PATH", &self.path)
            .env("PYENV_ROOT", root)
            .env("HOME", "/")
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(std::time::Duration::from_secs(20), which).await {
            Ok(Ok(out)) if out.status.success() => {
                let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                (p.is_absolute() && p.exists()).then_some(p).or(Some(found))
            }
            _ => {
                tracing::warn!(program = name, "pyenv which failed; running its shim");
                Some(found)
            }
        }
    }
}

/// `path` with only its absolute entries (an empty or relative entry is the working
/// directory: the agent's tree).
pub fn absolute_entries(path: &str) -> String {
    path.split(':')
        .filter(|e| e.starts_with('/'))
        .collect::<Vec<_>>()
        .join(":")
}

/// `test_command` for one test: `{test}` replaced by the shell-quoted id, or the id appended.
pub fn with_test(test_command: &str, test: &str) -> String {
    let quoted = format!("'{}'", test.replace('\'', r"'\''"));
    if test_command.contains("{test}") {
        test_command.replace("{test}", &quoted)
    } else {
        format!("{test_command} {quoted}")
    }
}

/// Whether `exe` resolves on `path`.
pub fn on_path(exe: &str, path: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|d| d.join(exe))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_id_is_quoted_into_the_command() {
        assert_eq!(
            with_test("python3 -m unittest", "test_a.T.test_x"),
            "python3 -m unittest 'test_a.T.test_x'"
        );
        assert_eq!(
            with_test("pytest {test} -q", "t.py::it's"),
            r"pytest 't.py::it'\''s' -q"
        );
    }

    fn files(f: &[&str]) -> Vec<String> {
        f.iter().map(|s| s.to_string()).collect()
    }

    fn render(command: &str, test_files: &[&str]) -> String {
        let Analysis::Pinned(p) = analyse(command, &files(test_files)).unwrap() else {
            panic!("{command} not analysed")
        };
        p.render(
            &|n| Some(PathBuf::from(format!("/node/bin/{n}"))),
            Path::new("/dev/null"),
            Path::new("/eval"),
        )
    }

    const BOOT: &str = "BOOT";

    fn short(s: String) -> String {
        s.replace(&quote(PYTHON_BOOTSTRAP), BOOT)
    }

    #[test]
    fn python_runners_run_isolated_with_the_tree_last() {
        assert_eq!(
            short(render("python3 -m unittest", &[])),
            "/node/bin/python3 -I -c BOOT m unittest"
        );
        assert_eq!(
            short(render("python3 -u -W ignore -m unittest -v test_calc", &[])),
            "/node/bin/python3 -I -u -W ignore -c BOOT m unittest -v test_calc"
        );
        assert_eq!(
            short(render("python3 -munittest discover -s tests", &[])),
            "/node/bin/python3 -I -c BOOT m unittest discover -s tests"
        );
        assert_eq!(
            short(render("python -c 'import calc'", &[])),
            "/node/bin/python -I -c BOOT code 'import calc'"
        );
        assert_eq!(
            short(render("cd tests && python3 run.py -q", &["tests/run.py"])),
            "cd tests && /node/bin/python3 -I -c BOOT script run.py -q"
        );
    }

    #[test]
    fn pytest_gets_its_configuration_only_from_the_test_files() {
        assert_eq!(
            short(render("python3 -m pytest -x tests", &[])),
            "/node/bin/python3 -I -c BOOT pytest pytest -p no:cacheprovider -c /dev/null --rootdir /eval -x tests"
        );
        assert_eq!(
            render("timeout 300 pytest 'tests/test_a.py::t[1]'", &[]),
            "/node/bin/timeout 300 /node/bin/pytest -p no:cacheprovider -c /dev/null --rootdir /eval 'tests/test_a.py::t[1]'"
        );
        assert_eq!(
            pytest_config(&files(&["tests", "pyproject.toml"])),
            Some("pyproject.toml")
        );
        assert_eq!(pytest_config(&files(&["sub/pytest.ini"])), None);
        let a = analyse("pytest", &[]).unwrap();
        assert!(runs_pytest(&a));
        assert!(!runs_pytest(&analyse("python3 -m unittest", &[]).unwrap()));
    }

    #[test]
    fn plain_programs_are_resolved_and_builtins_kept() {
        assert_eq!(render("test -f ok", &[]), "test -f ok");
        assert_eq!(
            render("grep -q done log.txt; true", &[]),
            "/node/bin/grep -q done log.txt ; true"
        );
        assert_eq!(
            render("sh run_tests.sh", &["run_tests.sh"]),
            "/node/bin/sh run_tests.sh"
        );
        assert_eq!(render("make test", &["Makefile"]), "/node/bin/make test");
        assert_eq!(render("/opt/t/run --all", &[]), "/opt/t/run --all");
    }

    /// Forms that run a file of the agent's tree as the runner: refused with a reason that
    /// names the file and the way out.
    #[test]
    fn commands_that_run_the_agents_files_are_refused() {
        for (command, names) in [
            ("sh run_tests.sh", "`run_tests.sh`"),
            ("bash -x scripts/test.sh", "`scripts/test.sh`"),
            ("./run_tests.sh", "`./run_tests.sh`"),
            ("python3 run_tests.py", "`run_tests.py`"),
            ("python3 -u tests/run.py", "`tests/run.py`"),
            ("cd tests && sh other.sh", "`other.sh`"),
            ("cd sub && sh tests/run.sh", "`tests/run.sh`"),
            ("true && . ./env.sh", "`./env.sh`"),
            ("node test.js", "`test.js`"),
            ("make test", "`Makefile`"),
            ("npm test", "`package.json`"),
        ] {
            let tf = files(&["tests/run.sh", "test_calc.py"]);
            let e = analyse(command, &tf).unwrap_err();
            assert!(
                e.contains(names) && e.contains("test_files"),
                "{command}: {e}"
            );
        }
        // Restored, they run.
        assert!(analyse("cd tests && sh run.sh", &files(&["tests"])).is_ok());
        assert!(analyse("python3 test_calc.py", &files(&["test_calc.py"])).is_ok());
    }

    #[test]
    fn other_shell_syntax_is_run_as_written_and_flagged() {
        for (command, says) in [
            ("python3 -m pytest 2>&1 | tail", "`>`"),
            ("PYTHONPATH=. python3 -m unittest", "PYTHONPATH=."),
            ("sh -c 'python3 -m unittest'", "sh -c"),
            ("env X=1 pytest", "env X=1"),
            ("echo $HOME", "`$`"),
            ("pytest tests/*.py", "`*`"),
            ("python3 --version", "--version"),
        ] {
            match analyse(command, &[]).unwrap() {
                Analysis::Unanalysed(why) => assert!(why.contains(says), "{command}: {why}"),
                a => panic!("{command}: {a:?}"),
            }
        }
    }

    #[test]
    fn quoting_round_trips_through_the_shell() {
        let words = ["a b", "it's", "", "$HOME", "t.py::x[1]", "plain-1.2"];
        let script = format!(
            "printf '%s\\n' {}",
            words.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
        );
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            words.map(|w| format!("{w}\n")).concat()
        );
        assert_eq!(
            tokenize(r#"a "b c" 'd'\ e && f"#).unwrap(),
            [
                Tok::Word("a".into()),
                Tok::Word("b c".into()),
                Tok::Word("d e".into()),
                Tok::Op("&&"),
                Tok::Word("f".into())
            ]
        );
        assert_eq!(absolute_entries(":/usr/bin:.:bin:/bin:"), "/usr/bin:/bin");
    }
}
