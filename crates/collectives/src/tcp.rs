//! TCP transport: a full mesh of connections, one per pair of ranks, with a reader thread
//! per connection feeding the rank's mailbox.

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::algo::{GroupComm, Transport};
use crate::comm::{CommOptions, Communicator};
use crate::error::{CommError, Result};
use crate::mailbox::Mailbox;
use crate::rendezvous::{RendezvousConfig, exchange_addresses, finish, open_store};
use crate::store::Store;

const HELLO_MAGIC: u64 = 0x736d_705f_6d65_7368; // "smp_mesh"
const HEADER: usize = 24;

#[derive(Debug)]
struct TcpTransport {
    rank: usize,
    mailbox: Arc<Mailbox>,
    /// Write halves, index = peer rank; `None` for self.
    peers: Vec<Option<Mutex<TcpStream>>>,
}

impl Transport for TcpTransport {
    fn global_rank(&self) -> usize {
        self.rank
    }

    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    fn send(
        &self,
        dst: usize,
        group: u64,
        tag: u64,
        payload: &[u8],
    ) -> std::result::Result<(), String> {
        let Some(stream) = &self.peers[dst] else {
            self.mailbox.push(group, self.rank, tag, payload.to_vec());
            return Ok(());
        };
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&group.to_le_bytes());
        header[8..16].copy_from_slice(&tag.to_le_bytes());
        header[16..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        let mut s = stream.lock().unwrap_or_else(|e| e.into_inner());
        // One write for small frames avoids a second packet under TCP_NODELAY.
        let res = if payload.len() <= 64 * 1024 {
            let mut frame = Vec::with_capacity(HEADER + payload.len());
            frame.extend_from_slice(&header);
            frame.extend_from_slice(payload);
            s.write_all(&frame)
        } else {
            s.write_all(&header).and_then(|_| s.write_all(payload))
        };
        res.map_err(|e| format!("sending to it failed: {e}"))
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Half-close: peers read everything already sent, then see EOF. A full close could
        // turn into a reset that discards data they have not read yet.
        for s in self.peers.iter().flatten() {
            let _ = s
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .shutdown(std::net::Shutdown::Write);
        }
    }
}

fn reader_loop(stream: TcpStream, peer: usize, mailbox: Arc<Mailbox>) {
    let mut r = BufReader::with_capacity(1 << 16, stream);
    let reason = loop {
        let mut h = [0u8; HEADER];
        if let Err(e) = r.read_exact(&mut h) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "end of stream".to_string()
            } else {
                e.to_string()
            };
        }
        let word =
            |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let (group, tag, len) = (word(0), word(1), word(2) as usize);
        let mut payload = vec![0u8; len];
        if let Err(e) = r.read_exact(&mut payload) {
            break format!("stream cut mid-message: {e}");
        }
        mailbox.push(group, peer, tag, payload);
    };
    tracing::debug!("connection to rank {peer} closed: {reason}");
    mailbox.close(peer, reason);
}

fn mesh_err(cfg: &RendezvousConfig, detail: String) -> CommError {
    CommError::Rendezvous {
        addr: format!("{}:{}", cfg.master_addr, cfg.master_port),
        detail,
    }
}

fn connect_peer(
    cfg: &RendezvousConfig,
    peer: usize,
    addr: &str,
    deadline: Instant,
) -> Result<TcpStream> {
    let sa: SocketAddr = addr.parse().map_err(|_| {
        mesh_err(
            cfg,
            format!("failed: rank {peer} published an unusable address {addr:?}"),
        )
    })?;
    loop {
        match TcpStream::connect_timeout(&sa, Duration::from_secs(2)) {
            Ok(mut s) => {
                let mut hello = Vec::with_capacity(24);
                hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
                hello.extend_from_slice(&(cfg.rank as u64).to_le_bytes());
                hello.extend_from_slice(&(cfg.world_size as u64).to_le_bytes());
                s.write_all(&hello)?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(mesh_err(
                    cfg,
                    format!(
                        "failed: rank {} could not connect to rank {peer} at {addr}: {e}",
                        cfg.rank
                    ),
                ));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn accept_peers(
    cfg: &RendezvousConfig,
    listener: &TcpListener,
    peers: &mut [Option<TcpStream>],
    deadline: Instant,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let expected = cfg.world_size - 1 - cfg.rank;
    let mut got = 0;
    while got < expected {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut hello = [0u8; 24];
                if let Err(e) = s.read_exact(&mut hello) {
                    tracing::warn!("dropping connection from {from}: no handshake ({e})");
                    continue;
                }
                let word = |i: usize| {
                    u64::from_le_bytes(hello[i * 8..i * 8 + 8].try_into().unwrap_or_default())
                };
                let (magic, peer, world) = (word(0), word(1) as usize, word(2) as usize);
                if magic != HELLO_MAGIC
                    || world != cfg.world_size
                    || peer <= cfg.rank
                    || peer >= cfg.world_size
                    || peers[peer].is_some()
                {
                    return Err(CommError::Protocol {
                        detail: format!(
                            "rank {} got an unexpected handshake from {from} (claims rank {peer} of world {world}, magic {magic:#x})",
                            cfg.rank
                        ),
                    });
                }
                s.set_read_timeout(None)?;
                peers[peer] = Some(s);
                got += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (cfg.rank + 1..cfg.world_size)
                        .filter(|&p| peers[p].is_none())
                        .collect();
                    return Err(mesh_err(
                        cfg,
                        format!(
                            "timed out after {:?} building the TCP mesh: rank {} never heard from ranks {missing:?}",
                            cfg.timeout, cfg.rank
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The world communicator for a process started by `smp-run`, torchrun or srun, with
/// options from [`CommOptions::from_env`]; a process started on its own (neither `RANK`
/// nor `SLURM_PROCID` set) gets a one-rank world that needs no network.
pub fn init_from_env() -> Result<Arc<dyn Communicator>> {
    let opts = CommOptions::from_env()?;
    if std::env::var_os("RANK").is_none() && std::env::var_os("SLURM_PROCID").is_none() {
        return Ok(crate::ThreadGroup::new(1, opts).remove(0));
    }
    init_tcp(&RendezvousConfig::from_env()?, opts)
}

/// Rendezvous through rank 0's store, then connects every pair of ranks over TCP.
pub fn init_tcp(cfg: &RendezvousConfig, opts: CommOptions) -> Result<Arc<dyn Communicator>> {
    Ok(init_tcp_with_store(cfg, opts)?.0)
}

/// Like [`init_tcp`], also returning the rendezvous store for further exchanges (e.g. an
/// NCCL unique id). On rank 0 the store is hosted by this process and serves the others
/// only while the returned `Store` lives.
pub fn init_tcp_with_store(
    cfg: &RendezvousConfig,
    opts: CommOptions,
) -> Result<(Arc<dyn Communicator>, Arc<Store>)> {
    let deadline = Instant::now() + cfg.timeout;
    let store = open_store(cfg)?;
    // The address this host uses to reach the store is one the other ranks can reach too.
    let listener = TcpListener::bind(SocketAddr::new(store.local_ip(), 0))?;
    let my_addr = listener.local_addr()?.to_string();
    let addrs = exchange_addresses(&store, cfg, &my_addr)?;
    let mut streams: Vec<Option<TcpStream>> = (0..cfg.world_size).map(|_| None).collect();
    // Lower ranks listen, higher ranks dial: each pair gets exactly one connection.
    for (peer, addr) in addrs.iter().enumerate().take(cfg.rank) {
        streams[peer] = Some(connect_peer(cfg, peer, addr, deadline)?);
    }
    accept_peers(cfg, &listener, &mut streams, deadline)?;
    let mailbox = Arc::new(Mailbox::default());
    let mut peers = Vec::with_capacity(cfg.world_size);
    for (peer, s) in streams.into_iter().enumerate() {
        let Some(s) = s else {
            peers.push(None);
            continue;
        };
        s.set_nodelay(true)?;
        // A peer that stops reading must not block a send forever.
        s.set_write_timeout(Some(opts.timeout))?;
        let read_half = s.try_clone()?;
        let mb = mailbox.clone();
        std::thread::Builder::new()
            .name(format!("tcp-r{}-from-{peer}", cfg.rank))
            .spawn(move || reader_loop(read_half, peer, mb))?;
        peers.push(Some(Mutex::new(s)));
    }
    finish(&store, cfg)?;
    tracing::debug!(
        "rank {} connected to {} peers",
        cfg.rank,
        cfg.world_size - 1
    );
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport {
        rank: cfg.rank,
        mailbox,
        peers,
    });
    let comm: Arc<dyn Communicator> = Arc::new(GroupComm::world(transport, cfg.world_size, opts));
    Ok((comm, Arc::new(store)))
}
