//! The engine as the reference: llama-server (built by scripts/setup) on the tiny test model
//! tokenizes every golden rendering (71 real templates' output, special tokens and all) with
//! `/tokenize` (`add_special: false`, `parse_special: true`, what it does to a rendered chat
//! prompt), and Tokenizer::from_gguf on the same file must give the same ids. The model's own
//! chat template, read from the GGUF, renders the golden conversations for a second set.
//!
//! Loopback only; the server is killed when the test ends. Missing artefacts fail the test.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_chat_template::{RenderOptions, Tokenizer};
use tokentap_schema::ChatRequest;

fn artefact(var: &str, default: &str) -> PathBuf {
    let p = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var("HOME").unwrap();
        Path::new(&home).join(".cache/tokentap").join(default)
    });
    assert!(
        p.is_file(),
        "{var}: {} is missing; run scripts/setup and source ~/.cache/tokentap/env.sh",
        p.display()
    );
    p
}

/// llama-server, killed on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange on loopback; the status and body.
fn http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "chunked answer: {head}"
    );
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, raw[split + 4..].to_vec()))
}

fn start(server: &Path, model: &Path) -> Server {
    let mut last = String::new();
    for _ in 0..3 {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(server)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-c", "1024", "-np", "1", "--threads", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", server.display()));
        let mut s = Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = s.child.try_wait() {
                last = format!("exited with {status}");
                break;
            }
            if let Ok((200, _)) = http(port, "GET", "/health", None) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if last.is_empty() {
            last = "not healthy within 60 s".into();
        }
        let _ = s.child.kill();
    }
    panic!("llama-server did not start: {last}");
}

fn server_ids(port: u16, text: &str) -> Vec<u32> {
    let (status, body) = http(
        port,
        "POST",
        "/tokenize",
        Some(&json!({"content": text, "add_special": false, "parse_special": true})),
    )
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn rendered_prompts_tokenize_as_llama_server_does() {
    let server_bin = artefact("TOKENTAP_LLAMA_SERVER", "bin/llama-server");
    let model = artefact("TOKENTAP_MODEL_TINY", "models/tiny-smollm2.gguf");
    let tok = Tokenizer::from_gguf(&model).unwrap();
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");

    let mut texts: Vec<(String, String)> = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(golden.join("expected"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for case in v["cases"].as_array().unwrap() {
            if let Some(out) = case["output"].as_str() {
                let name = format!("{} {}", v["template"], case["conversation"]);
                texts.push((name, out.to_owned()));
            }
        }
    }
    // The model's own template (from the GGUF) on the golden conversations.
    let templates = tok
        .chat_templates()
        .expect("the tiny model carries a chat template");
    let convs: Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("conversations.json")).unwrap())
            .unwrap();
    let mut own = 0;
    for c in convs["conversations"].as_array().unwrap() {
        let req: ChatRequest = serde_json::from_value(c["request"].clone()).unwrap();
        let opts = RenderOptions {
            add_generation_prompt: true,
            kwargs: tok.template_variables().clone(),
            ..Default::default()
        };
        if let Ok(text) = templates.render(&req, &opts) {
            own += 1;
            texts.push((format!("own template {}", c["name"]), text));
        }
    }
    assert!(
        own >= 10,
        "the model's template rendered {own} conversations"
    );
    assert!(texts.len() > 800, "{} texts", texts.len());

    let server = start(&server_bin, &model);
    let mut differ = Vec::new();
    for (name, text) in &texts {
        let want = server_ids(server.port, text);
        let got = tok.encode(text).unwrap();
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            differ.push(format!(
                "{name}: from token {at}: ours {:?} llama-server {:?}",
                &got[at..(at + 8).min(got.len())],
                &want[at..(at + 8).min(want.len())]
            ));
        }
    }
    eprintln!("{} texts tokenized, {} differ", texts.len(), differ.len());
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}
