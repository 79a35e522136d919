//! Job configuration from the environment (torchrun or Slurm) and the store-based
//! rendezvous that tells every rank where its peers listen.

use std::time::{Duration, Instant};

use crate::error::{CommError, Result};
use crate::store::Store;

/// Where this process sits in the job and how to reach rank 0's store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this node (selects the GPU).
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host of rank 0's store.
    pub master_addr: String,
    /// Port of rank 0's store.
    pub master_port: u16,
    /// How long rendezvous may take before failing with the missing ranks.
    pub timeout: Duration,
    /// The job's id, checked in the store's handshake so that two jobs given the same
    /// `MASTER_ADDR:MASTER_PORT` fail by name instead of joining each other: `SMP_RUN_ID`,
    /// else torchrun's `TORCHELASTIC_RUN_ID`, else Slurm's `SLURM_JOB_ID`; empty skips the check.
    pub run_id: String,
}

const DEFAULT_PORT: u16 = 29500;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

type Getter<'a> = &'a dyn Fn(&str) -> Option<String>;

fn parse_var<T: std::str::FromStr>(get: Getter, name: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<T>().map(Some).map_err(|e| {
            CommError::config(format!("environment variable {name}={v:?} is invalid: {e}"))
        }),
    }
}

fn require<T: std::str::FromStr>(get: Getter, name: &str, why: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    parse_var(get, name)?
        .ok_or_else(|| CommError::config(format!("environment variable {name} is not set ({why})")))
}

/// Reads a positive number of seconds (fractions allowed) from `name`.
pub(crate) fn env_secs(get: Getter, name: &str) -> Result<Option<Duration>> {
    match parse_var::<f64>(get, name)? {
        None => Ok(None),
        Some(s) if s > 0.0 && s.is_finite() => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(CommError::config(format!(
            "environment variable {name}={s} must be a positive number of seconds"
        ))),
    }
}

impl RendezvousConfig {
    /// Reads the process's environment; see [`RendezvousConfig::from_vars`].
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Builds the configuration from variables looked up through `get`.
    ///
    /// torchrun / `smp-run` variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) win; otherwise Slurm's
    /// (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` or
    /// `SLURM_TASKS_PER_NODE`, and the first host of `SLURM_JOB_NODELIST` as master unless
    /// `MASTER_ADDR` is set). `SMP_RENDEZVOUS_TIMEOUT_SECS` overrides the 300 s timeout.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get: Getter = &get;
        let timeout = env_secs(get, "SMP_RENDEZVOUS_TIMEOUT_SECS")?.unwrap_or(DEFAULT_TIMEOUT);
        let master_port = parse_var::<u16>(get, "MASTER_PORT")?.unwrap_or(DEFAULT_PORT);
        let run_id = ["SMP_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"]
            .iter()
            .find_map(|k| get(k).filter(|v| !v.trim().is_empty()))
            .unwrap_or_default();
        let cfg = if get("RANK").is_some() {
            let why = "RANK is set, so a torchrun-style launch is assumed";
            let rank = require(get, "RANK", why)?;
            let world_size = require(get, "WORLD_SIZE", why)?;
            RendezvousConfig {
                rank,
                world_size,
                local_rank: parse_var(get, "LOCAL_RANK")?.unwrap_or(rank),
                local_world_size: parse_var(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
                master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                master_port,
                timeout,
                run_id,
            }
        } else if get("SLURM_PROCID").is_some() {
            let why = "SLURM_PROCID is set, so a Slurm launch is assumed";
            let rank = require(get, "SLURM_PROCID", why)?;
            let world_size = require(get, "SLURM_NTASKS", why)?;
            let local_rank = require(get, "SLURM_LOCALID", why)?;
            let local_world_size = match parse_var::<usize>(get, "SLURM_NTASKS_PER_NODE")? {
                Some(n) => n,
                None => {
                    let spec: String = require(get, "SLURM_TASKS_PER_NODE", why)?;
                    let node = parse_var::<usize>(get, "SLURM_NODEID")?.unwrap_or(0);
                    tasks_on_node(&spec, node)?
                }
            };
            let master_addr = match get("MASTER_ADDR") {
                Some(a) => a,
                None => {
                    let var = if get("SLURM_JOB_NODELIST").is_some() {
                        "SLURM_JOB_NODELIST"
                    } else {
                        "SLURM_NODELIST"
                    };
                    let list: String = require(get, var, "needed to find the master host")?;
                    expand_nodelist(&list)?
                        .into_iter()
                        .next()
                        .ok_or_else(|| CommError::config(format!("{var}={list:?} names no host")))?
                }
            };
            RendezvousConfig {
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr,
                master_port,
                timeout,
                run_id,
            }
        } else {
            return Err(CommError::config(
                "neither RANK (torchrun / smp-run) nor SLURM_PROCID (srun) is set; \
                 launch with smp-run or srun",
            ));
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A one-process job on loopback, for tools and tests.
    pub fn single_process() -> Self {
        RendezvousConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            timeout: Duration::from_secs(30),
            run_id: String::new(),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(CommError::config("world size is 0"));
        }
        if self.rank >= self.world_size {
            return Err(CommError::config(format!(
                "rank {} is out of range for world size {}",
                self.rank, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(CommError::config(format!(
                "local rank {} is out of range for local world size {}",
                self.local_rank, self.local_world_size
            )));
        }
        Ok(())
    }
}

/// Tasks on node `node` from Slurm's compressed `SLURM_TASKS_PER_NODE`, e.g. `4(x2),3`.
fn tasks_on_node(spec: &str, node: usize) -> Result<usize> {
    let bad = || {
        CommError::config(format!(
            "SLURM_TASKS_PER_NODE={spec:?} is not of the form 4(x2),3"
        ))
    };
    let mut seen = 0;
    for part in spec.split(',') {
        let (n, reps) = match part.split_once("(x") {
            Some((n, r)) => (n, r.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        let reps: usize = reps.trim().parse().map_err(|_| bad())?;
        if node < seen + reps {
            return Ok(n);
        }
        seen += reps;
    }
    Err(CommError::config(format!(
        "SLURM_TASKS_PER_NODE={spec:?} describes {seen} nodes, but this is node {node}"
    )))
}

/// Expands a Slurm host list such as `node[01-04,07],gpu-a[1-3],login` into host names.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let bad = |why: &str| CommError::config(format!("host list {list:?} is invalid: {why}"));
    // Split on commas outside brackets.
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(bad("unbalanced or nested brackets"));
        }
    }
    items.push(&list[start..]);
    let mut hosts = Vec::new();
    for item in items.into_iter().map(str::trim).filter(|s| !s.is_empty()) {
        let Some((prefix, rest)) = item.split_once('[') else {
            hosts.push(item.to_string());
            continue;
        };
        let (ranges, suffix) = rest.split_once(']').ok_or_else(|| bad("missing ']'"))?;
        if suffix.contains('[') {
            return Err(bad("only one bracket group per host name is supported"));
        }
        for r in ranges.split(',') {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            let width = a.len();
            let lo: u64 = a
                .parse()
                .map_err(|_| bad(&format!("'{r}' is not a number range")))?;
            let hi: u64 = b
                .parse()
                .map_err(|_| bad(&format!("'{r}' is not a number range")))?;
            if hi < lo {
                return Err(bad(&format!("range '{r}' runs backwards")));
            }
            hosts.extend((lo..=hi).map(|n| format!("{prefix}{n:0width$}{suffix}")));
        }
    }
    Ok(hosts)
}

/// A TCP port that was free on `127.0.0.1` a moment ago (for launchers and tests).
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn rdzv_err(store: &Store, detail: String) -> CommError {
    CommError::Rendezvous {
        addr: store.addr().to_string(),
        detail,
    }
}

fn rank_key(r: usize) -> String {
    format!("smp/rank/{r}")
}

/// Connects to (rank 0: hosts) the store named by `cfg`.
pub(crate) fn open_store(cfg: &RendezvousConfig) -> Result<Store> {
    tracing::info!(
        "rendezvous: rank {} of {} at {}:{}, run {:?}, timeout {:?} (SMP_RENDEZVOUS_TIMEOUT_SECS)",
        cfg.rank,
        cfg.world_size,
        cfg.master_addr,
        cfg.master_port,
        cfg.run_id,
        cfg.timeout
    );
    if cfg.rank == 0 {
        Store::host_run(&cfg.master_addr, cfg.master_port, cfg.timeout, &cfg.run_id)
    } else {
        Store::connect_run(&cfg.master_addr, cfg.master_port, cfg.timeout, &cfg.run_id)
    }
}

/// Publishes `my_addr` and returns every rank's address, index = rank.
///
/// Rank 0 checks that all ranks agree on the world size and then publishes the address
/// list; any failure it detects is also published so other ranks fail with the same cause
/// instead of timing out.
pub(crate) fn exchange_addresses(
    store: &Store,
    cfg: &RendezvousConfig,
    my_addr: &str,
) -> Result<Vec<String>> {
    let deadline = Instant::now() + cfg.timeout;
    let world = cfg.world_size;
    if store.add(&format!("smp/joined/{}", cfg.rank), 1)? > 1 {
        return Err(rdzv_err(
            store,
            format!(
                "failed: rank {} joined twice (two processes were given RANK={})",
                cfg.rank, cfg.rank
            ),
        ));
    }
    if cfg.rank == 0 {
        store.set("smp/world_size", world.to_string().as_bytes())?;
    }
    store.set(&rank_key(cfg.rank), format!("{world};{my_addr}").as_bytes())?;
    let keys: Vec<String> = (0..world).map(rank_key).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let timed_out = |store: &Store| -> Result<CommError> {
        let present = store.check(&key_refs)?;
        let missing: Vec<usize> = (0..world).filter(|&r| !present[r]).collect();
        Ok(rdzv_err(
            store,
            format!(
                "timed out after {:?}: {} of {world} ranks arrived; missing ranks {missing:?}",
                cfg.timeout,
                world - missing.len()
            ),
        ))
    };
    if cfg.rank != 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        let theirs = match store.get_timeout("smp/world_size", left) {
            Ok(v) => String::from_utf8_lossy(&v).into_owned(),
            Err(_) => return Err(timed_out(store)?),
        };
        if theirs != world.to_string() {
            return Err(rdzv_err(
                store,
                format!(
                    "failed: rank {} was started with WORLD_SIZE={world} but rank 0 has WORLD_SIZE={theirs}",
                    cfg.rank
                ),
            ));
        }
    }
    loop {
        if store.check(&["smp/abort"])?[0] {
            let msg = store.get("smp/abort")?;
            return Err(rdzv_err(store, String::from_utf8_lossy(&msg).into_owned()));
        }
        if cfg.rank == 0 {
            if store.check(&key_refs)?.iter().all(|&p| p) {
                let mut addrs = Vec::with_capacity(world);
                for (r, key) in keys.iter().enumerate() {
                    let v = String::from_utf8_lossy(&store.get(key)?).into_owned();
                    let (claim, addr) = v.split_once(';').unwrap_or(("?", ""));
                    if claim != world.to_string() {
                        let detail = format!(
                            "failed: rank {r} was started with WORLD_SIZE={claim} but rank 0 has WORLD_SIZE={world}"
                        );
                        store.set("smp/abort", detail.as_bytes())?;
                        return Err(rdzv_err(store, detail));
                    }
                    addrs.push(addr.to_string());
                }
                store.set("smp/peers", addrs.join("\n").as_bytes())?;
                return Ok(addrs);
            }
        } else if store.check(&["smp/peers"])?[0] {
            let v = String::from_utf8_lossy(&store.get("smp/peers")?).into_owned();
            return Ok(v.split('\n').map(str::to_string).collect());
        }
        if Instant::now() >= deadline {
            let err = timed_out(store)?;
            if cfg.rank == 0 {
                let _ = store.set("smp/abort", err.to_string().as_bytes());
            }
            return Err(err);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Keeps rank 0's store alive until every rank has finished with it.
pub(crate) fn finish(store: &Store, cfg: &RendezvousConfig) -> Result<()> {
    store.set(&format!("smp/connected/{}", cfg.rank), b"1")?;
    if cfg.rank == 0 {
        let keys: Vec<String> = (0..cfg.world_size)
            .map(|r| format!("smp/connected/{r}"))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&refs, cfg.timeout)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn nodelists() {
        assert_eq!(
            expand_nodelist("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(
            expand_nodelist("gpu-a[1-3],login,x[9-10]y").unwrap(),
            ["gpu-a1", "gpu-a2", "gpu-a3", "login", "x9y", "x10y"]
        );
        assert!(expand_nodelist("n[1-").is_err());
        assert_eq!(tasks_on_node("4(x2),3", 2).unwrap(), 3);
        assert_eq!(tasks_on_node("4(x2),3", 1).unwrap(), 4);
    }

    #[test]
    fn torchrun_env() {
        let c = RendezvousConfig::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("SMP_RENDEZVOUS_TIMEOUT_SECS", "2.5"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.1", 1234));
        assert_eq!(c.timeout, Duration::from_millis(2500));
    }

    #[test]
    fn run_id_from_the_launcher() {
        let id = |extra: &[(&str, &str)]| {
            let all: Vec<_> = [("RANK", "0"), ("WORLD_SIZE", "1")]
                .into_iter()
                .chain(extra.iter().copied())
                .collect();
            RendezvousConfig::from_vars(vars(&all)).unwrap().run_id
        };
        assert_eq!(id(&[]), "");
        assert_eq!(id(&[("TORCHELASTIC_RUN_ID", "t1")]), "t1");
        assert_eq!(
            id(&[("SLURM_JOB_ID", "77"), ("SMP_RUN_ID", "mine")]),
            "mine"
        );
    }

    #[test]
    fn slurm_env() {
        let c = RendezvousConfig::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(c.master_addr, "gpu07");
    }

    #[test]
    fn bad_env_names_variable_and_value() {
        let e = RendezvousConfig::from_vars(vars(&[("RANK", "x1"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x1\""), "{e}");
        let e = RendezvousConfig::from_vars(vars(&[("RANK", "1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("WORLD_SIZE is not set"), "{e}");
        let e = RendezvousConfig::from_vars(vars(&[("RANK", "4"), ("WORLD_SIZE", "4")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 4") && e.contains("world size 4"), "{e}");
        let e = RendezvousConfig::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "99999"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT=\"99999\""), "{e}");
        assert!(RendezvousConfig::from_vars(vars(&[])).is_err());
    }
}
