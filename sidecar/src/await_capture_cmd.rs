//! `tokentap await-capture`: the init container the webhook injects into transparent-mode
//! pods. It returns once the pod's connects are redirected to the node agent, so no container
//! of the pod reaches the model API before capture. It proves the redirect itself rather than
//! asking the agent: it connects to an address on a redirected port, which reaches the agent
//! only once the pod's cgroup is attached (before that, the connect goes where it was aimed —
//! nothing listens there inside the pod — and is refused).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use tokentap_proxy::transparent::{
    AWAIT_CAPTURE_ATTACHED, AWAIT_CAPTURE_NOT_CAPTURED, AWAIT_CAPTURE_PROBE,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Args)]
pub struct AwaitCaptureArgs {
    /// Where to probe: any address on a redirected port (the agent's --redirect-port, 443 by
    /// default); inside the pod nothing answers there until the redirect is on.
    #[arg(long, default_value = "127.0.0.1:443")]
    probe: SocketAddr,
    /// Give up after this many seconds (exit 1).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

/// How often the probe is retried.
const RETRY: Duration = Duration::from_millis(200);
/// One attempt's connect and answer deadline.
const ATTEMPT: Duration = Duration::from_secs(2);

/// What one probe learned.
#[derive(Debug, PartialEq, Eq)]
enum Probe {
    Attached(String),
    NotCaptured,
    /// Refused, timed out, or something else answered.
    NotYet(String),
}

async fn probe_once(at: SocketAddr) -> Probe {
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(at).await?;
        conn.write_all(AWAIT_CAPTURE_PROBE).await?;
        let mut answer = Vec::with_capacity(256);
        (&mut conn).take(4096).read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    match tokio::time::timeout(ATTEMPT, attempt).await {
        Err(_) => Probe::NotYet("no answer in time".into()),
        Ok(Err(e)) => Probe::NotYet(e.to_string()),
        Ok(Ok(a)) => {
            if let Some(session) = a.strip_prefix(AWAIT_CAPTURE_ATTACHED) {
                Probe::Attached(session.trim_end().to_owned())
            } else if a == AWAIT_CAPTURE_NOT_CAPTURED {
                Probe::NotCaptured
            } else {
                Probe::NotYet("something else answered (not the node agent)".into())
            }
        }
    }
}

pub fn run(args: AwaitCaptureArgs) -> anyhow::Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    loop {
        let last = match rt.block_on(probe_once(args.probe)) {
            Probe::Attached(session) => {
                eprintln!("tokentap: this pod's model traffic is captured (session {session:?})");
                return Ok(ExitCode::SUCCESS);
            }
            Probe::NotCaptured => "the node agent redirects this pod but does not capture it (is it annotated tokentap.io/capture: \"true\"?)".to_owned(),
            Probe::NotYet(why) => why,
        };
        if Instant::now() >= deadline {
            eprintln!(
                "tokentap await-capture: this pod's connects were not redirected to a node agent within {} s (last probe of {}: {last}). Is the tokentap node-agent DaemonSet running on this node, with --redirect-port covering {}, and the pod annotated tokentap.io/capture: \"true\"?",
                args.timeout,
                args.probe,
                args.probe.port()
            );
            return Ok(ExitCode::FAILURE);
        }
        std::thread::sleep(RETRY);
    }
}
