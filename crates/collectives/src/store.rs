//! A small TCP key-value store for rendezvous, in the spirit of torch's `TCPStore`.
//!
//! Rank 0 hosts it; every rank (rank 0 included) talks to it through a client connection.
//! Blocking reads wait on the server side, so a `get` costs one round trip however long
//! the key takes to appear.
//!
//! Every connection opens with a handshake: the client sends [`MAGIC`], the protocol version
//! and the run id, the server answers with the same magic and a status. So a wrong port (an
//! HTTP server, another job's store, an old build) is named as such within the timeout instead
//! of surfacing later as a garbled reply or a wait that never ends.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_WAIT: u8 = 5;
const MAX_FIELD: u64 = 1 << 30;

/// The first bytes of every connection, in both directions.
pub const MAGIC: &[u8; 8] = b"SMPSTORE";
/// The store protocol spoken here; a peer with another one is refused by name.
pub const PROTOCOL_VERSION: u32 = 1;
/// How long a server waits for a new connection's handshake before dropping it.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
const HELLO_OK: u8 = 0;
const HELLO_BAD_VERSION: u8 = 1;
const HELLO_OTHER_RUN: u8 = 2;

fn write_bytes(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    w.write_all(&(b.len() as u64).to_le_bytes())?;
    w.write_all(b)
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_u8(r: &mut impl Read) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u64(r)?;
    if n > MAX_FIELD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("store field of {n} bytes exceeds the {MAX_FIELD}-byte limit"),
        ));
    }
    // Grown as bytes arrive, so a damaged length costs no gigabyte up front.
    let mut b = Vec::with_capacity(n.min(1 << 16) as usize);
    r.take(n).read_to_end(&mut b)?;
    if (b.len() as u64) < n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(b)
}

fn read_key(r: &mut impl Read) -> std::io::Result<String> {
    String::from_utf8(read_bytes(r)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
    /// The run this store serves; clients of another run are refused (empty: any run).
    run_id: String,
}

impl Shared {
    /// Waits until all `keys` exist or `timeout` passes; true when all exist.
    fn wait_keys(&self, keys: &[String], timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if keys.iter().all(|k| map.contains_key(k)) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            map = self
                .cv
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Reads a client's hello and answers it; `Ok(false)` when the client is refused.
    fn handshake(
        &self,
        r: &mut BufReader<TcpStream>,
        w: &mut BufWriter<TcpStream>,
    ) -> std::io::Result<bool> {
        r.get_ref().set_read_timeout(Some(HANDSHAKE_WAIT))?;
        let mut magic = [0u8; 8];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            // Not a store client: say nothing a foreign protocol could misread.
            return Ok(false);
        }
        let mut version = [0u8; 4];
        r.read_exact(&mut version)?;
        let version = u32::from_le_bytes(version);
        let run_id = read_key(r)?;
        w.write_all(MAGIC)?;
        w.write_all(&PROTOCOL_VERSION.to_le_bytes())?;
        let accepted = if version != PROTOCOL_VERSION {
            w.write_all(&[HELLO_BAD_VERSION])?;
            false
        } else if !self.run_id.is_empty() && !run_id.is_empty() && run_id != self.run_id {
            w.write_all(&[HELLO_OTHER_RUN])?;
            write_bytes(w, self.run_id.as_bytes())?;
            false
        } else {
            w.write_all(&[HELLO_OK])?;
            true
        };
        w.flush()?;
        r.get_ref().set_read_timeout(None)?;
        Ok(accepted)
    }

    fn serve(&self, stream: TcpStream) -> std::io::Result<()> {
        let mut r = BufReader::new(stream.try_clone()?);
        let mut w = BufWriter::new(stream);
        if !self.handshake(&mut r, &mut w)? {
            return Ok(());
        }
        loop {
            let op = match read_u8(&mut r) {
                Ok(op) => op,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            };
            match op {
                OP_SET => {
                    let k = read_key(&mut r)?;
                    let v = read_bytes(&mut r)?;
                    self.map
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(k, v);
                    self.cv.notify_all();
                    w.write_all(&[0])?;
                }
                OP_GET => {
                    let k = read_key(&mut r)?;
                    let t = Duration::from_millis(read_u64(&mut r)?);
                    if self.wait_keys(std::slice::from_ref(&k), t) {
                        let v = self.map.lock().unwrap_or_else(|e| e.into_inner())[&k].clone();
                        w.write_all(&[0])?;
                        write_bytes(&mut w, &v)?;
                    } else {
                        w.write_all(&[1])?;
                    }
                }
                OP_ADD => {
                    let k = read_key(&mut r)?;
                    let delta = read_u64(&mut r)? as i64;
                    let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
                    let cur = map
                        .get(&k)
                        .and_then(|v| <[u8; 8]>::try_from(&v[..]).ok())
                        .map(i64::from_le_bytes)
                        .unwrap_or(0);
                    let new = cur.wrapping_add(delta);
                    map.insert(k, new.to_le_bytes().to_vec());
                    drop(map);
                    self.cv.notify_all();
                    w.write_all(&[0])?;
                    w.write_all(&new.to_le_bytes())?;
                }
                OP_CHECK | OP_WAIT => {
                    let n = read_u64(&mut r)?;
                    let keys = (0..n)
                        .map(|_| read_key(&mut r))
                        .collect::<std::io::Result<Vec<_>>>()?;
                    if op == OP_WAIT {
                        let t = Duration::from_millis(read_u64(&mut r)?);
                        let ok = self.wait_keys(&keys, t);
                        w.write_all(&[if ok { 0 } else { 1 }])?;
                    } else {
                        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
                        let present: Vec<u8> =
                            keys.iter().map(|k| map.contains_key(k) as u8).collect();
                        drop(map);
                        w.write_all(&[0])?;
                        write_bytes(&mut w, &present)?;
                    }
                }
                other => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("unknown store request {other}"),
                    ));
                }
            }
            w.flush()?;
        }
    }
}

/// Stops the accept loop when the hosting [`Store`] is dropped.
struct Server {
    stop: Arc<AtomicBool>,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn start_server(bind: IpAddr, port: u16, run_id: &str) -> std::io::Result<Server> {
    let listener = TcpListener::bind(SocketAddr::new(bind, port))?;
    let port = listener.local_addr()?.port();
    // Polling lets the thread notice `stop` without a self-connection trick.
    listener.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared {
        run_id: run_id.to_string(),
        ..Shared::default()
    });
    let stop2 = stop.clone();
    std::thread::Builder::new()
        .name(format!("store-{port}"))
        .spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, peer)) => {
                        let shared = shared.clone();
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_nodelay(true);
                        let _ = std::thread::Builder::new()
                            .name(format!("store-conn-{peer}"))
                            .spawn(move || {
                                if let Err(e) = shared.serve(s) {
                                    tracing::debug!("store connection from {peer} ended: {e}");
                                }
                            });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => {
                        tracing::warn!("store accept failed: {e}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })?;
    Ok(Server { stop, port })
}

/// The client's side of the handshake: sends the hello and checks the answer, waiting at
/// most `left` (at least a second, so a slow but genuine store is not misjudged).
fn hello(
    r: &mut BufReader<TcpStream>,
    w: &mut BufWriter<TcpStream>,
    addr: &str,
    run_id: &str,
    left: Duration,
) -> Result<()> {
    let wait = left.max(Duration::from_secs(1));
    let fail = |detail: String| CommError::Rendezvous {
        addr: addr.to_string(),
        detail,
    };
    let not_a_store = |what: String| {
        fail(format!(
            "failed: the service at {addr} is not an smp-burn rendezvous store ({what}); \
             is MASTER_PORT the port rank 0 listens on?"
        ))
    };
    let io = |e: std::io::Error| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            not_a_store(format!(
                "it accepted the connection but sent no handshake within {wait:?}"
            ))
        } else if e.kind() == std::io::ErrorKind::UnexpectedEof {
            not_a_store("it closed the connection at the handshake".into())
        } else {
            fail(format!("failed: store handshake: {e}"))
        }
    };
    let send = |w: &mut BufWriter<TcpStream>| -> std::io::Result<()> {
        w.write_all(MAGIC)?;
        w.write_all(&PROTOCOL_VERSION.to_le_bytes())?;
        write_bytes(w, run_id.as_bytes())?;
        w.flush()
    };
    send(w).map_err(io)?;
    r.get_ref().set_read_timeout(Some(wait)).map_err(io)?;
    let mut magic = [0u8; 8];
    let mut got = 0;
    while got < magic.len() {
        match r.read(&mut magic[got..]) {
            Ok(0) if got > 0 => break,
            Ok(0) => return Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) => return Err(io(e)),
        }
    }
    if &magic[..got] != MAGIC {
        let text: String = String::from_utf8_lossy(&magic[..got])
            .chars()
            .map(|c| if c.is_control() { '.' } else { c })
            .collect();
        return Err(not_a_store(format!("it answered {text:?}")));
    }
    let mut version = [0u8; 4];
    r.read_exact(&mut version).map_err(io)?;
    let version = u32::from_le_bytes(version);
    let status = read_u8(r).map_err(io)?;
    match status {
        HELLO_OK => Ok(()),
        HELLO_BAD_VERSION => Err(fail(format!(
            "failed: the store speaks protocol version {version}, this build speaks \
             {PROTOCOL_VERSION}: run the same build on every rank"
        ))),
        HELLO_OTHER_RUN => {
            let theirs = read_key(r).map_err(io)?;
            Err(fail(format!(
                "failed: the store at {addr} belongs to run {theirs:?}, this rank is in run \
                 {run_id:?}: two jobs share MASTER_ADDR:MASTER_PORT"
            )))
        }
        other => Err(fail(format!("failed: unknown handshake status {other}"))),
    }
}

/// Client of the rendezvous key-value store, optionally also its host.
///
/// Keys are strings, values are bytes. The hosting instance serves other ranks for as long
/// as it lives, so the host must outlive everyone's use of the store.
pub struct Store {
    addr: String,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    local_ip: IpAddr,
    timeout: Duration,
    server: Option<Server>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("hosting", &self.server.is_some())
            .finish()
    }
}

impl Store {
    /// Hosts a store on all interfaces at `port` (0 picks a free one; see [`Store::port`]),
    /// then connects to it through `host` (the address other ranks use). Serves any run.
    pub fn host(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        Self::host_run(host, port, timeout, "")
    }

    /// [`Store::host`] for the run `run_id`: clients that name another run are refused, with
    /// both ids in their error (an empty id on either side skips the check).
    pub fn host_run(host: &str, port: u16, timeout: Duration, run_id: &str) -> Result<Store> {
        let bind: IpAddr = match host.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        };
        let server = start_server(bind, port, run_id).map_err(|e| CommError::Rendezvous {
            addr: format!("{host}:{port}"),
            detail: format!("failed: rank 0 could not listen on port {port}: {e}"),
        })?;
        let mut store = Store::connect_run(host, server.port, timeout, run_id)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to a store at `host:port`, retrying until `timeout` passes; `timeout` is
    /// also the default wait of [`Store::get`] and [`Store::wait`].
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        Self::connect_run(host, port, timeout, "")
    }

    /// [`Store::connect`] as a member of the run `run_id` (see [`Store::host_run`]).
    ///
    /// # Errors
    /// Besides an unreachable store: a service at that address that does not answer the
    /// store's handshake (wrong port), another protocol version, or another run's store.
    pub fn connect_run(host: &str, port: u16, timeout: Duration, run_id: &str) -> Result<Store> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let mut last_err = String::from("no attempt made");
        loop {
            match (host, port).to_socket_addrs() {
                Ok(addrs) => {
                    for sa in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(2));
                        match TcpStream::connect_timeout(&sa, attempt) {
                            Ok(s) => {
                                s.set_nodelay(true)?;
                                let local_ip = s.local_addr()?.ip();
                                let mut r = BufReader::new(s.try_clone()?);
                                let mut w = BufWriter::new(s);
                                let left = deadline.saturating_duration_since(Instant::now());
                                hello(&mut r, &mut w, &addr, run_id, left)?;
                                return Ok(Store {
                                    addr,
                                    conn: Mutex::new((r, w)),
                                    local_ip,
                                    timeout,
                                    server: None,
                                });
                            }
                            Err(e) => last_err = e.to_string(),
                        }
                    }
                }
                Err(e) => last_err = format!("cannot resolve '{host}': {e}"),
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous {
                    addr,
                    detail: format!(
                        "failed: could not reach the store within {timeout:?} (last error: {last_err}); \
                         is rank 0 running and MASTER_ADDR/MASTER_PORT right?"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `host:port` this client talks to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Port of the store (the actual one when hosted on port 0).
    pub fn port(&self) -> u16 {
        match &self.server {
            Some(s) => s.port,
            None => self
                .addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0),
        }
    }

    /// This machine's address on the route to the store, which other ranks can reach.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// The default wait of blocking operations.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn io_err(&self, e: std::io::Error) -> CommError {
        CommError::Rendezvous {
            addr: self.addr.clone(),
            detail: format!("failed: lost the connection to the store: {e}"),
        }
    }

    /// Sends one request and returns the status byte with the reader for the rest.
    fn request<T>(
        &self,
        wait: Duration,
        write: impl FnOnce(&mut BufWriter<TcpStream>) -> std::io::Result<()>,
        read: impl FnOnce(u8, &mut BufReader<TcpStream>) -> std::io::Result<T>,
    ) -> Result<T> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let (r, w) = &mut *conn;
        let go = || -> std::io::Result<T> {
            write(w)?;
            w.flush()?;
            // The server answers after at most `wait`; the slack covers the round trip.
            r.get_ref()
                .set_read_timeout(Some(wait + Duration::from_secs(30)))?;
            let status = read_u8(r)?;
            read(status, r)
        };
        go().map_err(|e| self.io_err(e))
    }

    /// Stores `value` under `key`, replacing any previous value.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(
            Duration::ZERO,
            |w| {
                w.write_all(&[OP_SET])?;
                write_bytes(w, key.as_bytes())?;
                write_bytes(w, value)
            },
            |_, _| Ok(()),
        )
    }

    /// The value of `key`, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.request(
            timeout,
            |w| {
                w.write_all(&[OP_GET])?;
                write_bytes(w, key.as_bytes())?;
                w.write_all(&(timeout.as_millis() as u64).to_le_bytes())
            },
            |status, r| {
                if status == 0 {
                    read_bytes(r).map(Some)
                } else {
                    Ok(None)
                }
            },
        )?
        .ok_or_else(|| CommError::Rendezvous {
            addr: self.addr.clone(),
            detail: format!("timed out after {timeout:?} waiting for key '{key}'"),
        })
    }

    /// Adds `delta` to the counter at `key` (starting from 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.request(
            Duration::ZERO,
            |w| {
                w.write_all(&[OP_ADD])?;
                write_bytes(w, key.as_bytes())?;
                w.write_all(&delta.to_le_bytes())
            },
            |_, r| read_u64(r).map(|v| v as i64),
        )
    }

    /// Which of `keys` are set right now.
    pub fn check(&self, keys: &[&str]) -> Result<Vec<bool>> {
        self.request(
            Duration::ZERO,
            |w| {
                w.write_all(&[OP_CHECK])?;
                w.write_all(&(keys.len() as u64).to_le_bytes())?;
                keys.iter().try_for_each(|k| write_bytes(w, k.as_bytes()))
            },
            |_, r| read_bytes(r).map(|v| v.into_iter().map(|b| b != 0).collect()),
        )
    }

    /// Waits up to `timeout` until every key in `keys` is set; the error names the keys
    /// still missing.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let ok = self.request(
            timeout,
            |w| {
                w.write_all(&[OP_WAIT])?;
                w.write_all(&(keys.len() as u64).to_le_bytes())?;
                keys.iter().try_for_each(|k| write_bytes(w, k.as_bytes()))?;
                w.write_all(&(timeout.as_millis() as u64).to_le_bytes())
            },
            |status, _| Ok(status == 0),
        )?;
        if ok {
            return Ok(());
        }
        let present = self.check(keys)?;
        let missing: Vec<&str> = keys
            .iter()
            .zip(present)
            .filter(|(_, p)| !p)
            .map(|(k, _)| *k)
            .collect();
        Err(CommError::Rendezvous {
            addr: self.addr.clone(),
            detail: format!("timed out after {timeout:?} waiting for keys {missing:?}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_foreign_service_is_named_within_the_timeout() {
        // A service that accepts and never answers: the wait must still end at the timeout.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = silent.local_addr().unwrap().port();
        let keep = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
        let t = Instant::now();
        let e = Store::connect("127.0.0.1", port, Duration::from_millis(1500))
            .unwrap_err()
            .to_string();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            e.contains("not an smp-burn rendezvous store") && e.contains("no handshake"),
            "{e}"
        );
        drop(keep);
        // A service that answers something else (an HTTP server).
        let http = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = http.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = http.accept().unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let e = Store::connect("127.0.0.1", port, Duration::from_secs(2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not an smp-burn rendezvous store") && e.contains("HTTP/1.1"),
            "{e}"
        );
        server.join().unwrap();
    }

    #[test]
    fn another_runs_store_is_refused_with_both_ids() {
        let host = Store::host_run("127.0.0.1", 0, Duration::from_secs(2), "job-a").unwrap();
        let e = Store::connect_run("127.0.0.1", host.port(), Duration::from_secs(2), "job-b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("job-a") && e.contains("job-b"), "{e}");
        // Same run, or a client that names no run, gets in.
        Store::connect_run("127.0.0.1", host.port(), Duration::from_secs(2), "job-a").unwrap();
        Store::connect("127.0.0.1", host.port(), Duration::from_secs(2)).unwrap();
    }

    #[test]
    fn set_get_add_wait() {
        let host = Store::host("127.0.0.1", 0, Duration::from_secs(2)).unwrap();
        let client = Store::connect("127.0.0.1", host.port(), Duration::from_secs(2)).unwrap();
        host.set("a", b"1").unwrap();
        assert_eq!(client.get("a").unwrap(), b"1");
        assert_eq!(client.add("n", 2).unwrap(), 2);
        assert_eq!(host.add("n", 3).unwrap(), 5);
        assert_eq!(client.check(&["a", "b"]).unwrap(), vec![true, false]);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            host.set("b", b"late").unwrap();
            host
        });
        assert_eq!(client.get("b").unwrap(), b"late");
        let host = t.join().unwrap();
        let err = client
            .wait(&["a", "zz"], Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[\"zz\"]"), "{err}");
        drop(host);
    }
}
