//! Every `tokentap …` command line the README and the capture manual show names a command the
//! binary has and only flags that command takes: each line's command is found by asking the
//! binary (`tokentap WORDS --help`, dropping trailing words that are arguments), and each
//! `--flag` on it must be in that help. A page that keeps a renamed or removed flag fails here.
//! The positive control: the same check on a line with a flag no command has fails.

use std::collections::BTreeSet;
use std::process::Command;

use tokentap_e2e::artefacts::{tokentap_bin, workspace_root};

/// The pages whose shell blocks users copy from.
const PAGES: &[&str] = &["README.md", "docs/capture.md"];

/// The `tokentap …` lines of a page's ```sh blocks (a `# comment` cut, `[…]` options kept).
fn documented_lines(page: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    for line in page.lines() {
        let t = line.trim_start();
        if t.starts_with("```") {
            in_sh = !in_sh && t.trim_start_matches('`').trim() == "sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = t.split(" # ").next().unwrap_or(t).trim();
        // `sudo tokentap …`, `VAR=x tokentap …`: from the binary's name on.
        if let Some(at) = code
            .find("tokentap ")
            .filter(|&at| at == 0 || code[..at].ends_with(' '))
        {
            if !code[at..].starts_with("tokentap_") {
                lines.push(code[at..].to_owned());
            }
        }
    }
    lines
}

fn help(words: &[&str]) -> Option<String> {
    let out = Command::new(tokentap_bin())
        .args(words)
        .arg("--help")
        .output()
        .expect("tokentap runs");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Err: what is wrong with `line`.
fn check(line: &str) -> Result<(), String> {
    // The command's own words end at its first option; a separator `--` ends its flags.
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    let own: Vec<&str> = words
        .iter()
        .take_while(|w| !w.starts_with('-') && !w.starts_with('['))
        .copied()
        .collect();
    let flags: BTreeSet<&str> = words
        .iter()
        .take_while(|w| **w != "--" && **w != "|")
        .map(|w| w.trim_start_matches('['))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split(['=', ']', ',']).next().unwrap_or(w))
        .collect();
    let (command, help) = (0..=own.len())
        .rev()
        .find_map(|n| Some((own[..n].join(" "), help(&own[..n])?)))
        .ok_or_else(|| format!("`{line}`: `tokentap --help` failed"))?;
    if command.is_empty() && !own.is_empty() {
        return Err(format!("`{line}`: no command `tokentap {}`", own[0]));
    }
    let missing: Vec<&str> = flags
        .into_iter()
        .filter(|f| {
            *f != "--help"
                && !help.contains(&format!("{f} "))
                && !help.contains(&format!("{f}\n"))
                && !help.contains(&format!("{f}="))
                && !help.contains(&format!("{f},"))
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "`{line}`: `tokentap {command}` takes no {}",
            missing.join(", ")
        ))
    }
}

#[test]
fn every_documented_command_line_names_real_commands_and_flags() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    for page in PAGES {
        let text = std::fs::read_to_string(workspace_root().join(page)).unwrap();
        let lines = documented_lines(&text);
        assert!(!lines.is_empty(), "{page} shows no tokentap command");
        for line in lines {
            checked += 1;
            if let Err(e) = check(&line) {
                wrong.push(format!("{page}: {e}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    eprintln!("{checked} documented command lines checked");

    // Positive controls: a flag no command has, and a command the binary does not have.
    let bad = check("tokentap proxy --listen 127.0.0.1:8800 --no-such-flag 1").unwrap_err();
    assert!(bad.ends_with("takes no --no-such-flag"), "{bad}");
    assert!(check("tokentap no-such-command --x").is_err());
}
