//! The real program in the real kernel (root, cgroup v2; loopback only): a process in the
//! target cgroup connecting to 127.0.0.2:PORT reaches the listener instead, which learns the
//! original destination; a process outside is not redirected (its connect is refused, as
//! nothing listens there); after detaching, nothing is redirected any more.

use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokentap_cgroup::Cgroup;
use tokentap_ebpf::{Redirect, RedirectConfig};

/// Root and cgroup v2, or the test fails under `TOKENTAP_REQUIRE_PRIVILEGED=1` (CI) and
/// reports its skip otherwise.
fn privileged() -> bool {
    tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2())
}

/// A port nothing listens on at 127.0.0.2 (the "hard-coded endpoint").
fn dead_port() -> u16 {
    let l = TcpListener::bind("127.0.0.2:0").unwrap();
    l.local_addr().unwrap().port()
}

/// `bash -c` connecting to `dest` and writing `hi`, started inside `cgroup` (or not).
fn connect_from(cgroup: Option<&Cgroup>, dest: SocketAddr) -> std::process::Child {
    let script = format!(
        "exec 3<>/dev/tcp/{}/{} && printf hi >&3 && sleep 0.2",
        dest.ip(),
        dest.port()
    );
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &script]).stderr(Stdio::piped());
    if let Some(cg) = cgroup {
        let procs = cg.procs_file();
        // SAFETY: only writes a file before exec.
        unsafe {
            cmd.pre_exec(move || std::fs::write(&procs, "0"));
        }
    }
    cmd.spawn().unwrap()
}

#[test]
fn connects_from_the_cgroup_reach_the_listener_with_their_destination() {
    if !privileged() {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let SocketAddr::V4(at) = listener.local_addr().unwrap() else {
        unreachable!()
    };
    let port = dead_port();
    let dest: SocketAddr = SocketAddrV4::new("127.0.0.2".parse().unwrap(), port).into();
    let cg = Cgroup::create(&format!("test-redirect-{}", std::process::id())).unwrap();
    let redirect = Redirect::attach(
        cg.path(),
        &RedirectConfig {
            listener: at,
            listener_v6: None,
            ports: vec![port],
        },
    )
    .unwrap();

    // Inside: redirected, with the original destination known.
    let mut child = connect_from(Some(&cg), dest);
    listener.set_nonblocking(false).unwrap();
    let (mut conn, peer) = listener.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = [0u8; 2];
    conn.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hi");
    assert_eq!(redirect.original_destination(peer), Some(dest));
    assert_eq!(
        redirect.original_destination(peer),
        None,
        "entries are consumed"
    );
    assert!(child.wait().unwrap().success());

    // Outside: not redirected, so the connect is refused locally.
    let out = connect_from(None, dest).wait_with_output().unwrap();
    assert!(!out.status.success(), "an outside connect was not refused");

    // Another port from inside: not redirected either.
    let other: SocketAddr = SocketAddrV4::new("127.0.0.2".parse().unwrap(), dead_port()).into();
    let out = connect_from(Some(&cg), other).wait_with_output().unwrap();
    assert!(!out.status.success(), "an unlisted port was redirected");

    // The listener's own address is never rewritten (no loop).
    let mut direct = TcpStream::connect(at).unwrap();
    direct.write_all(b"x").unwrap();
    let (_c, p) = listener.accept().unwrap();
    assert_eq!(redirect.original_destination(p), None);

    // Detached: inside connects go where they were sent (and are refused).
    drop(redirect);
    let out = connect_from(Some(&cg), dest).wait_with_output().unwrap();
    assert!(!out.status.success(), "still redirected after detaching");
    let path = cg.path().to_owned();
    cg.remove().unwrap();
    assert!(!path.exists());
}
