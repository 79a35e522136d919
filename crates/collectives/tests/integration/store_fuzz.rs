//! The store's server fed damaged requests: no request may take it down or make it hang past
//! its timeout; a well-formed client connected afterwards is served as usual.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use collectives::Store;

/// A valid hello (magic, protocol version 1, an empty run id) so that the damage reaches the
/// request parser rather than the handshake.
fn hello() -> Vec<u8> {
    let mut b = b"SMPSTORE".to_vec();
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b
}

#[test]
fn damaged_requests_leave_the_store_serving() {
    let host = Store::host("127.0.0.1", 0, Duration::from_secs(5)).unwrap();
    host.set("key", b"value").unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // A valid `set` request to damage: op 1, key "k", value "v".
    let mut set = vec![1u8];
    for field in [&b"k"[..], &b"v"[..]] {
        set.extend_from_slice(&(field.len() as u64).to_le_bytes());
        set.extend_from_slice(field);
    }
    for case in 0..200 {
        let mut s = TcpStream::connect(("127.0.0.1", host.port())).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut msg = if case % 4 == 0 { Vec::new() } else { hello() };
        let mut req = set.clone();
        let at = (next() as usize) % req.len();
        match next() % 3 {
            0 => req[at] = next() as u8,
            1 => req.truncate(at),
            _ => {
                req.splice(at..at, next().to_le_bytes());
            }
        }
        msg.extend_from_slice(&req);
        let _ = s.write_all(&msg);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // Whatever comes back, it comes back (or the connection closes) within the timeout.
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    let client = Store::connect("127.0.0.1", host.port(), Duration::from_secs(5)).unwrap();
    assert_eq!(client.get("key").unwrap(), b"value");
}
