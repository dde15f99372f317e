//! The TLS ClientHello peek (proxy/src/tls/sni.rs): what a new connection on the transparent
//! listener opens with decides whether it is intercepted, so it runs on any bytes.
//! Invariants: a ClientHello is only ever found in a TLS handshake record, its server name is
//! a DNS name as rustls accepts it (ASCII, no spaces, at most 253 bytes), and the answer is
//! the same for the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::tls::sni::{parse_client_hello, Opening};

fuzz_target!(|data: &[u8]| {
    let opening = parse_client_hello(data);
    assert_eq!(opening, parse_client_hello(data));
    match &opening {
        Opening::TlsClientHello { server_name } => {
            assert_eq!(data.first(), Some(&0x16), "a handshake record");
            if let Some(name) = server_name {
                assert!(!name.is_empty() && name.len() <= 253, "{name:?}");
                assert!(
                    name.bytes().all(|b| b.is_ascii_graphic() && b != b'/'),
                    "{name:?}"
                );
            }
        }
        Opening::Other => {}
        Opening::Silent => panic!("parsing bytes never says the peer was silent"),
    }
});
