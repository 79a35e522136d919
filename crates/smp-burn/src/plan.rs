//! Clusters and what their collectives cost: the model-agnostic half of a performance planner.
//!
//! A [`Cluster`] is nodes of identical GPUs joined by two kinds of links: the one inside a node
//! (NVLink / NVSwitch) and the network between nodes (EFA, InfiniBand). [`Cluster::collective`]
//! predicts the time of an all-gather, reduce-scatter or all-reduce over a group of ranks laid
//! out as this crate's meshes lay them out ([`crate::mesh`]: tensor-parallel peers are
//! neighbours, then the shard axis, then replicas), so that the groups hybrid sharding creates
//! (shard groups inside a node, replica groups across nodes) are priced by the link they cross.
//!
//! The cost of one collective is the ring model NCCL's own tuning uses: `(p - 1)` latency steps
//! and `(p - 1) / p` of the buffer over the slowest link a ring step crosses (the bus bandwidth
//! of nccl-tests), with all-reduce as a reduce-scatter plus an all-gather or, when latency
//! dominates, a tree (`2 log2 p` steps). A group that spans nodes shares each node's network
//! bandwidth with every other group doing the same collective at the same time on that node.
//! [`Link::fit`] derives a link from measured collectives (`collective_bench`'s output), so that
//! the numbers come from the machine rather than a datasheet where one can be measured.

use serde::{Deserialize, Serialize};

use crate::error::SmpError;

/// A link's cost model: `latency + bytes / bus_bandwidth` per ring step, as nccl-tests define
/// bus bandwidth (all-gather and reduce-scatter move `(p - 1) / p` of the buffer per rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bus bandwidth in bytes per second (for the network: per node, all its NICs together).
    pub bus_bytes_per_s: f64,
    /// Seconds per ring step.
    pub latency_s: f64,
}

/// One GPU kind: its memory and dense peaks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Name as the planner prints it.
    pub name: String,
    /// Device memory in bytes (what the driver reports as total).
    pub memory_bytes: u64,
    /// Dense bf16 tensor-core peak, FLOP/s.
    pub peak_bf16_flops: f64,
    /// Dense FP8 tensor-core peak, FLOP/s, where the GPU has FP8.
    pub peak_fp8_flops: Option<f64>,
}

/// Nodes of identical GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Name as the planner prints it (a preset's name, or `custom`).
    pub name: String,
    /// Nodes in the job.
    pub nodes: usize,
    /// GPUs (ranks) per node.
    pub gpus_per_node: usize,
    /// The GPU of every rank.
    pub gpu: Gpu,
    /// Between GPUs of one node.
    pub intra_node: Link,
    /// Between nodes: bandwidth of one node's NICs together.
    pub inter_node: Link,
}

/// The collectives the engine issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// Every rank ends with the whole buffer (FSDP's parameter gather, sequence-parallel
    /// gathers).
    AllGather,
    /// Every rank ends with its slice of the sum (FSDP's gradient reduction).
    ReduceScatter,
    /// Every rank ends with the whole sum (gradients between replicas).
    AllReduce,
}

/// A group of ranks in mesh order: `size` ranks `stride` apart (tensor-parallel groups have
/// stride 1, shard groups stride `tp`, replica groups stride `tp * shard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// Ranks in the group.
    pub size: usize,
    /// Distance between consecutive members in global rank order.
    pub stride: usize,
}

const GIB: u64 = 1 << 30;

impl Cluster {
    /// Preset names accepted by [`Cluster::preset`].
    pub const PRESETS: [&'static str; 3] = ["p4d", "p5", "h200"];

    /// A named cluster of `nodes` nodes:
    /// - `p4d`: AWS p4d.24xlarge, 8 A100-SXM4-40GB (312 TFLOP/s bf16), NVSwitch, 4 x 100 Gb/s
    ///   EFA per node;
    /// - `p5`: AWS p5.48xlarge, 8 H100-SXM-80GB (989.4 TFLOP/s bf16, 1,979 FP8), NVSwitch,
    ///   32 x 100 Gb/s EFA per node;
    /// - `h200`: 8 H200-SXM-141GB per node (989.4 / 1,979), NVSwitch, 8 x 400 Gb/s per node
    ///   (an HGX H200 with one 400 Gb/s NIC per GPU, as p5en and DGX H200 have).
    ///
    /// The NVLink figures of `h200` are fitted to the two-H200 `collective_bench` run in the
    /// docs; the others, and every network, are what NCCL's tests reach on such links (about
    /// 80 % of the line rate), not measured here: fit your own with [`Link::fit`].
    ///
    /// # Errors
    /// An unknown name (the message lists the presets) or zero nodes.
    pub fn preset(name: &str, nodes: usize) -> Result<Self, SmpError> {
        if nodes == 0 {
            return Err(SmpError::Usage(format!(
                "a cluster of {nodes} nodes: need at least one"
            )));
        }
        let gbps = |gb: f64| gb * 1e9;
        let us = |t: f64| t * 1e-6;
        let (gpu, intra, inter) = match name {
            "p4d" => (
                Gpu {
                    name: "A100-SXM4-40GB".into(),
                    memory_bytes: 40_536 * (1 << 20),
                    peak_bf16_flops: 312e12,
                    peak_fp8_flops: None,
                },
                Link {
                    bus_bytes_per_s: gbps(200.0),
                    latency_s: us(8.0),
                },
                Link {
                    bus_bytes_per_s: gbps(40.0),
                    latency_s: us(30.0),
                },
            ),
            "p5" => (
                Gpu {
                    name: "H100-SXM-80GB".into(),
                    memory_bytes: 80 * GIB,
                    peak_bf16_flops: 989.4e12,
                    peak_fp8_flops: Some(1978.9e12),
                },
                Link {
                    bus_bytes_per_s: gbps(340.0),
                    latency_s: us(8.0),
                },
                Link {
                    bus_bytes_per_s: gbps(320.0),
                    latency_s: us(25.0),
                },
            ),
            "h200" => (
                Gpu {
                    name: "H200-SXM-141GB".into(),
                    memory_bytes: 143_771 * (1 << 20),
                    peak_bf16_flops: 989.4e12,
                    peak_fp8_flops: Some(1978.9e12),
                },
                H200_NVLINK,
                Link {
                    bus_bytes_per_s: gbps(320.0),
                    latency_s: us(15.0),
                },
            ),
            other => {
                return Err(SmpError::Usage(format!(
                    "unknown cluster preset '{other}'; known presets: {}",
                    Self::PRESETS.join(", ")
                )));
            }
        };
        Ok(Self {
            name: name.into(),
            nodes,
            gpus_per_node: 8,
            gpu,
            intra_node: intra,
            inter_node: inter,
        })
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }

    /// Seconds for `op` over `group` on a buffer of `bytes` (the whole buffer: the gathered
    /// output, the reduce-scatter input, the all-reduced tensor), while every other group of
    /// the same shape runs the same collective (as every mesh axis' groups do in lockstep).
    pub fn collective(&self, op: Collective, bytes: f64, group: Group) -> f64 {
        let p = group.size;
        if p <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let g = self.gpus_per_node.max(1);
        let span = p * group.stride;
        let (bandwidth, latency) = if span <= g || self.nodes <= 1 {
            (self.intra_node.bus_bytes_per_s, self.intra_node.latency_s)
        } else {
            // Members per node, and how many groups of this shape share one node's network:
            // a ring leaves and enters each node once, carrying `(p - 1) / p` of the buffer.
            let per_node = (g / group.stride.min(g)).max(1);
            let sharing = (g / per_node).max(1) as f64;
            let network = self.inter_node.bus_bytes_per_s / sharing;
            (
                network.min(self.intra_node.bus_bytes_per_s),
                self.inter_node.latency_s,
            )
        };
        let share = (p - 1) as f64 / p as f64;
        let ring_steps = (p - 1) as f64;
        match op {
            Collective::AllGather | Collective::ReduceScatter => {
                ring_steps * latency + share * bytes / bandwidth
            }
            Collective::AllReduce => {
                let ring = 2.0 * ring_steps * latency;
                let tree = 2.0 * (p as f64).log2().ceil() * latency;
                ring.min(tree) + 2.0 * share * bytes / bandwidth
            }
        }
    }
}

/// The NVLink of an H200 node, fitted by [`Link::fit`] to the all-gathers and reduce-scatters
/// of `collective_bench` on two H200s (docs/collectives.md: 16 MiB to 1 GiB through the Burn
/// bridge, 107-266 GB/s bus bandwidth; each within 10 %).
pub const H200_NVLINK: Link = Link {
    bus_bytes_per_s: 255e9,
    latency_s: 40e-6,
};

/// One timed collective: what [`Link::fit`] learns from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveSample {
    /// The collective.
    pub op: Collective,
    /// Ranks in the group.
    pub ranks: usize,
    /// The whole buffer, as [`Cluster::collective`] counts it.
    pub bytes: f64,
    /// Measured seconds.
    pub seconds: f64,
}

impl Link {
    /// The link whose ring model best fits `samples` (least squares on the time, each sample
    /// weighted by its own size so that large and small buffers count alike).
    ///
    /// # Errors
    /// Fewer than two samples, or samples that fit no positive bandwidth and latency (all of
    /// one size, or times falling with size).
    pub fn fit(samples: &[CollectiveSample]) -> Result<Link, SmpError> {
        // seconds = steps * latency + volume / bandwidth; unknowns (latency, 1 / bandwidth).
        let rows: Vec<(f64, f64, f64)> = samples
            .iter()
            .filter(|s| s.ranks > 1)
            .map(|s| {
                let p = s.ranks as f64;
                let (steps, volume) = match s.op {
                    Collective::AllGather | Collective::ReduceScatter => {
                        (p - 1.0, s.bytes * (p - 1.0) / p)
                    }
                    Collective::AllReduce => (2.0 * (p - 1.0), 2.0 * s.bytes * (p - 1.0) / p),
                };
                let w = 1.0 / s.seconds.max(1e-9);
                (steps * w, volume * w, s.seconds * w)
            })
            .collect();
        if rows.len() < 2 {
            return Err(SmpError::Usage(format!(
                "fitting a link needs at least two timed collectives over 2+ ranks, got {}",
                rows.len()
            )));
        }
        let (mut aa, mut ab, mut bb, mut ay, mut by) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(a, b, y) in &rows {
            aa += a * a;
            ab += a * b;
            bb += b * b;
            ay += a * y;
            by += b * y;
        }
        let det = aa * bb - ab * ab;
        let latency = (ay * bb - by * ab) / det;
        let inverse_bandwidth = (aa * by - ab * ay) / det;
        if !(det.abs() > 0.0 && inverse_bandwidth > 0.0 && latency.is_finite()) {
            return Err(SmpError::Usage(format!(
                "the {} timed collectives fit no positive bandwidth (latency {latency:e} s, \
                 1/bandwidth {inverse_bandwidth:e} s/B): time them over several sizes",
                rows.len()
            )));
        }
        Ok(Link {
            bus_bytes_per_s: 1.0 / inverse_bandwidth,
            latency_s: latency.max(0.0),
        })
    }
}

/// Parses `collective_bench`'s `RESULT|op|bytes|variant|ms|busbw_GBps` lines for `variant`
/// (`burn`, `nccl`, ...) run over `ranks` ranks into samples for [`Link::fit`]; other lines are
/// skipped.
pub fn parse_collective_bench(text: &str, variant: &str, ranks: usize) -> Vec<CollectiveSample> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.trim().strip_prefix("RESULT|")?.split('|');
            let op = match f.next()? {
                "all_gather" => Collective::AllGather,
                "reduce_scatter" => Collective::ReduceScatter,
                "all_reduce" => Collective::AllReduce,
                _ => return None,
            };
            let bytes: f64 = f.next()?.parse().ok()?;
            if f.next()? != variant {
                return None;
            }
            let ms: f64 = f.next()?.parse().ok()?;
            Some(CollectiveSample {
                op,
                ranks,
                bytes,
                seconds: ms * 1e-3,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bus bandwidths of docs/collectives.md (two H200s, the Burn bridge, all-gather and
    /// reduce-scatter from 16 MiB) turned back into times: the fit recovers [`H200_NVLINK`] and
    /// predicts every one of them within 10 %.
    #[test]
    fn nvlink_fit_reproduces_the_two_h200_collectives() {
        let measured = [
            (Collective::AllGather, 16.0, 106.8),
            (Collective::AllGather, 64.0, 191.7),
            (Collective::AllGather, 256.0, 234.5),
            (Collective::AllGather, 1024.0, 266.0),
            (Collective::ReduceScatter, 16.0, 126.4),
            (Collective::ReduceScatter, 64.0, 182.9),
            (Collective::ReduceScatter, 256.0, 221.7),
            (Collective::ReduceScatter, 1024.0, 260.7),
        ];
        let samples: Vec<_> = measured
            .iter()
            .map(|&(op, mib, busbw)| {
                let bytes = mib * (1 << 20) as f64;
                CollectiveSample {
                    op,
                    ranks: 2,
                    bytes,
                    seconds: bytes * 0.5 / (busbw * 1e9),
                }
            })
            .collect();
        let link = Link::fit(&samples).unwrap();
        assert!(
            (link.bus_bytes_per_s / H200_NVLINK.bus_bytes_per_s - 1.0).abs() < 0.05
                && (link.latency_s / H200_NVLINK.latency_s - 1.0).abs() < 0.15,
            "fitted {link:?} against {H200_NVLINK:?}"
        );
        let cluster = Cluster {
            intra_node: link,
            ..Cluster::preset("h200", 1).unwrap()
        };
        for s in &samples {
            let t = cluster.collective(s.op, s.bytes, Group { size: 2, stride: 1 });
            assert!(
                (t / s.seconds - 1.0).abs() < 0.1,
                "{:?} {} B: {t} s against {} s",
                s.op,
                s.bytes,
                s.seconds
            );
        }
    }

    #[test]
    fn collective_bench_lines_parse_for_one_variant() {
        let text = "RESULT|all_gather|1048576|burn|0.5|1.0\nRESULT|all_gather|1048576|nccl|0.4|1\n\
                    noise\nRESULT|broadcast|1|burn|1|1\nRESULT|reduce_scatter|2097152|burn|0.75|2";
        let s = parse_collective_bench(text, "burn", 8);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].op, Collective::AllGather);
        assert_eq!(s[1].bytes, 2097152.0);
        assert!((s[1].seconds - 0.75e-3).abs() < 1e-12);
    }

    /// Groups are priced by the link they cross: a shard group inside a node by NVLink, the
    /// same size spanning nodes by the node's network shared with the groups beside it, and a
    /// 1,024-rank ring by its latency.
    #[test]
    fn groups_are_priced_by_the_links_they_cross() {
        let c = Cluster::preset("p4d", 128).unwrap();
        let gib = GIB as f64;
        let inside = c.collective(Collective::AllGather, gib, Group { size: 8, stride: 1 });
        let across = c.collective(Collective::AllGather, gib, Group { size: 8, stride: 8 });
        assert!(across > 4.0 * inside, "{across} against {inside}");
        // Replica groups of 8-rank shard groups: each node's 8 ranks belong to 8 different
        // groups, all crossing the network at once.
        let replicas = c.collective(
            Collective::AllReduce,
            gib,
            Group {
                size: 128,
                stride: 8,
            },
        );
        let alone = Cluster {
            gpus_per_node: 1,
            ..c.clone()
        }
        .collective(
            Collective::AllReduce,
            gib,
            Group {
                size: 128,
                stride: 1,
            },
        );
        assert!(replicas > 7.0 * alone, "{replicas} against {alone}");
        let full = c.collective(
            Collective::AllGather,
            1e6,
            Group {
                size: 1024,
                stride: 1,
            },
        );
        assert!(full > 1023.0 * c.inter_node.latency_s);
        assert!(
            Cluster::preset("p3", 1)
                .unwrap_err()
                .to_string()
                .contains("p4d, p5, h200")
        );
    }
}
