//! Training metrics: a JSON-lines log (one object per step), a dependency-free SVG loss chart,
//! and the GPUs' peak FLOP/s that model FLOPs utilisation (MFU) is measured against.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use smp_burn::Precision;

use crate::error::{LlamaError, Result};

/// What one optimizer step measured. Written as one JSON object per line by [`MetricsLog`].
///
/// Non-finite floats (a diverged loss) are written as `null`, which JSON requires; the
/// required float fields read `null` back as NaN so that such a log stays readable.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps completed, counting from 1.
    pub step: u64,
    /// Mean training cross-entropy of the step, nats/token.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Validation cross-entropy, on the steps that evaluate.
    #[serde(default)]
    pub val_loss: Option<f64>,
    /// Learning rate used by the step.
    #[serde(deserialize_with = "nan_if_null")]
    pub lr: f64,
    /// Global gradient L2 norm before clipping.
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    /// Training tokens processed per second, all devices together.
    #[serde(deserialize_with = "nan_if_null")]
    pub tokens_per_sec: f64,
    /// Achieved model TFLOP/s per device.
    #[serde(deserialize_with = "nan_if_null")]
    pub tflops_per_device: f64,
    /// Model FLOPs utilisation: achieved over peak FLOP/s, in `[0, 1]`.
    #[serde(deserialize_with = "nan_if_null")]
    pub mfu: f64,
    /// Peak device memory in bytes, where the backend reports it.
    #[serde(default)]
    pub peak_mem_bytes: Option<u64>,
    /// Host time spent inside collective calls during the step, where measured. On CUDA this
    /// includes waiting for CubeCL's full launch queue when the host runs ahead of the GPU, so
    /// it is not exposed communication.
    #[serde(default)]
    pub comm_wait_ms: Option<f64>,
    /// Device time of this step's collectives (NCCL, CUDA events). With `prefetch_depth` 1 part
    /// of it runs beside compute; the step minus a run without collectives is what is exposed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_device_ms: Option<f64>,
    /// Host time until forward and backward of the step were queued (before the optimizer);
    /// close to the step time when the step is host-bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_issue_ms: Option<f64>,
}

fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// An append-only JSON-lines file of [`StepMetrics`], flushed after every line so that the log
/// is current even if the run is killed.
#[derive(Debug)]
pub struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    /// Starts a new log at `path`, replacing any existing file (parent directories are
    /// created).
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        create_parent(path)?;
        let file = File::create(path).map_err(|e| LlamaError::io(path, e))?;
        Ok(MetricsLog {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Continues the log of a run resumed after `step`: lines of later steps (written after
    /// the checkpoint being resumed) are dropped so that each step appears once, then new lines
    /// are appended. A missing file is started afresh.
    pub fn resume(path: impl AsRef<Path>, step: u64) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Self::create(path);
        }
        let kept: Vec<StepMetrics> = read_metrics(path)?
            .into_iter()
            .filter(|m| m.step <= step)
            .collect();
        let tmp = path.with_extension("jsonl.tmp");
        {
            let mut log = Self::create(&tmp)?;
            for m in &kept {
                log.log(m)?;
            }
        }
        std::fs::rename(&tmp, path).map_err(|e| LlamaError::io(path, e))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| LlamaError::io(path, e))?;
        Ok(MetricsLog {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends one line and flushes it.
    pub fn log(&mut self, metrics: &StepMetrics) -> Result<()> {
        let mut line = serde_json::to_string(metrics).expect("StepMetrics always serializes");
        line.push('\n');
        // One write per line, so a concurrent reader never sees half a record from us.
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| LlamaError::io(&self.path, e))
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads a log written by [`MetricsLog`]. A final line without its newline (the run was killed
/// mid-write) is ignored; any other unreadable line is an error naming the line.
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<StepMetrics>> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| LlamaError::io(path, e))?;
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(m) => out.push(m),
            Err(_) if i + 1 == lines.len() && !complete => {}
            Err(e) => {
                return Err(LlamaError::Data(format!(
                    "{}:{}: {e}",
                    path.display(),
                    i + 1
                )));
            }
        }
    }
    Ok(out)
}

fn create_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => {
            std::fs::create_dir_all(p).map_err(|e| LlamaError::io(p, e))
        }
        _ => Ok(()),
    }
}

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 450.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// More points than pixels only makes the file larger.
const MAX_POINTS: usize = 2000;
const TRAIN_COLOUR: &str = "#1f77b4";
const VAL_COLOUR: &str = "#d62728";

/// Writes a line chart of training and validation loss against step as a standalone SVG.
///
/// The y axis is linear and spans the finite values (non-finite points are skipped); a
/// training series longer than 2000 points is thinned to every k-th point (keeping the last).
/// The validation series is drawn with point markers since it is usually sparse.
pub fn write_loss_plot_svg(
    path: impl AsRef<Path>,
    train: &[(u64, f64)],
    val: &[(u64, f64)],
    title: &str,
) -> Result<()> {
    let path = path.as_ref();
    let train = thin(finite(train));
    let val = finite(val);
    let all = || train.iter().chain(&val);
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all() {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1.0 {
        x1 = x0 + 1.0;
    }
    if y1 - y0 < 1e-9 {
        let pad = (y0.abs() * 0.1).max(0.5);
        (y0, y1) = (y0 - pad, y1 + pad);
    }
    let ystep = nice_step((y1 - y0) / 5.0);
    let (y0, y1) = ((y0 / ystep).floor() * ystep, (y1 / ystep).ceil() * ystep);
    let xstep = nice_step((x1 - x0) / 6.0).max(1.0);

    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * plot_w;
    let sy = |y: f64| TOP + (y1 - y) / (y1 - y0) * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="16">{}</text>"#,
        WIDTH / 2.0,
        xml_escape(title)
    );
    // Grid and tick labels.
    let decimals = decimals_for(ystep);
    let mut y = y0;
    while y <= y1 + ystep * 1e-6 {
        let py = sy(y);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{y:.decimals$}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            py + 4.0
        );
        y += ystep;
    }
    let mut x = (x0 / xstep).ceil() * xstep;
    while x <= x1 + xstep * 1e-6 {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#e0e0e0"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{x}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0
        );
        x += xstep;
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 10.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">loss (nats/token)</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );

    let polyline = |pts: &[(f64, f64)], colour: &str, s: &mut String| {
        let coords: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
            coords.join(" ")
        );
    };
    let mut legend: Vec<(&str, &str)> = Vec::new();
    if !train.is_empty() {
        polyline(&train, TRAIN_COLOUR, &mut s);
        legend.push(("train", TRAIN_COLOUR));
    }
    if !val.is_empty() {
        polyline(&val, VAL_COLOUR, &mut s);
        for &(x, y) in &val {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{VAL_COLOUR}"/>"#,
                sx(x),
                sy(y)
            );
        }
        legend.push(("validation", VAL_COLOUR));
    }
    if legend.is_empty() {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">no data</text>"#,
            LEFT + plot_w / 2.0,
            TOP + plot_h / 2.0
        );
    }
    for (i, (label, colour)) in legend.iter().enumerate() {
        let lx = LEFT + plot_w - 110.0;
        let ly = TOP + 18.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{ly:.1}">{label}</text>"#,
            ly - 4.0,
            lx + 24.0,
            ly - 4.0,
            lx + 30.0
        );
    }
    s.push_str("</svg>\n");

    create_parent(path)?;
    std::fs::write(path, s).map_err(|e| LlamaError::io(path, e))
}

fn finite(points: &[(u64, f64)]) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|&(x, y)| (x as f64, y))
        .collect()
}

fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points;
    }
    let stride = points.len().div_ceil(MAX_POINTS);
    let mut out: Vec<(f64, f64)> = points.iter().step_by(stride).copied().collect();
    if out.last() != points.last() {
        out.extend(points.last());
    }
    out
}

/// 1, 2 or 5 times a power of ten, at least `raw`: tick spacings people read easily.
/// A step of 1, 2 or 5 times a power of ten near `raw`: tick spacing for the plots.
pub(crate) fn nice_step(raw: f64) -> f64 {
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let m = raw / mag;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn decimals_for(step: f64) -> usize {
    (-step.log10().floor()).max(0.0) as usize
}

/// `s` as SVG text content or attribute value.
pub(crate) fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

/// Dense (no 2:4 sparsity) tensor-core peak FLOP/s per GPU for 16-bit inputs, bf16 or f16,
/// with fp32 accumulation (the two are equal on every GPU listed): the denominator of MFU when
/// the model computes in bf16. Looked up by [`device_peak_flops`] on the CUDA device name
/// (`cuDeviceGetName`: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"); an entry matches when
/// each of its words is a word of the name, and the first match wins, so a variant (PCIe, NVL)
/// comes before its family.
///
/// The figures are NVIDIA's: datasheets print them with sparsity, twice the dense rate,
/// marked with an asterisk. Sources, dense:
/// - B200, B100: HGX B200 / HGX B100 datasheets, 36 / 28 PFLOP/s FP16/BF16 with sparsity for
///   8 GPUs. GB200: GB200 NVL72 datasheet, 360 PFLOP/s with sparsity for 72 GPUs.
/// - H100 SXM 989.4, PCIe 756: the NVIDIA H100 Tensor Core GPU Architecture whitepaper
///   (Table: "Peak BF16 Tensor TFLOPS with FP32 Accumulate"); H100 NVL: H100 datasheet,
///   1,671 with sparsity.
/// - H200 and H200 NVL: H200 datasheet, 1,979 / 1,671 with sparsity. GH200: GH200 datasheet,
///   1,979 with sparsity. H800: H100 silicon with a narrower NVLink, the H100's rates.
/// - H20: no public NVIDIA datasheet; 148 is the dense FP16/BF16 figure of NVIDIA's partner
///   spec sheets.
/// - A100 (SXM and PCIe) and A800: A100 datasheet, 312 (624 with sparsity). A30: 165. A40:
///   149.7. A10: 125 (their datasheets).
/// - A10G (AWS G5): no NVIDIA datasheet; 70 is the figure quoted for it: GA102's rate with
///   fp32 accumulation at half speed, as on GeForce GA102, at its 80 SMs. Least certain
///   entry: set `--peak-tflops` from a measurement where it matters.
/// - L40S 362.05, L40 181.05, L4 121: their datasheets (733 / 362.1 / 242 with sparsity).
/// - RTX 4090 165.2 and RTX 3090 71: the Ada (AD102) and Ampere (GA102) whitepapers, "Peak
///   BF16 Tensor TFLOPS with FP32 Accumulate" (GeForce runs fp32 accumulation at half the
///   fp16-accumulate rate).
pub const PEAK_FLOPS_16BIT: &[(&str, f64)] = &[
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("GH200", 989.4e12),
    ("H200 NVL", 835.5e12),
    ("H200", 989.4e12),
    ("H100 NVL", 835.5e12),
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H800 PCIe", 756e12),
    ("H800", 989.4e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A30", 165e12),
    ("A40", 149.7e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362.05e12),
    ("L40", 181.05e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71e12),
];

/// The dense 16-bit tensor-core peak of the GPU named `device_name` ([`PEAK_FLOPS_16BIT`]), or
/// `None` for a GPU the table lacks. Words are compared whole and without case, so "A10" is
/// not "A100" and "L4" not "L40S".
pub fn device_peak_flops(device_name: &str) -> Option<f64> {
    let words = |s: &str| -> Vec<String> {
        s.split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .map(str::to_ascii_uppercase)
            .collect()
    };
    let name = words(device_name);
    PEAK_FLOPS_16BIT
        .iter()
        .find(|(pattern, _)| words(pattern).iter().all(|w| name.contains(w)))
        .map(|&(_, flops)| flops)
}

/// The peak FLOP/s per GPU that MFU is measured against: `peak_tflops` where the user gave it,
/// else the table's figure for `device_name` when the model computes in bf16.
///
/// # Errors
/// Why there is no MFU figure, in one line that says how to get one: f32 compute (the table
/// holds 16-bit rates), a device the table lacks (named), or no device name.
pub fn mfu_peak_flops(
    device_name: Option<&str>,
    compute: Precision,
    peak_tflops: Option<f64>,
) -> std::result::Result<f64, String> {
    if let Some(t) = peak_tflops {
        return Ok(t * 1e12);
    }
    let how = "set the GPU's peak with --peak-tflops N (peak_tflops = N in a config file)";
    if compute == Precision::F32 {
        return Err(format!(
            "MFU is not reported for f32 compute (the peak table holds 16-bit tensor-core \
             rates); {how}"
        ));
    }
    match device_name {
        Some(name) => device_peak_flops(name).ok_or_else(|| {
            format!("MFU is not reported: no peak FLOP/s known for the GPU \"{name}\"; {how}")
        }),
        None => Err(format!(
            "MFU is not reported: the CUDA device name could not be read; {how}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(i: u64, loss: f64) -> StepMetrics {
        StepMetrics {
            step: i,
            loss,
            val_loss: i.is_multiple_of(2).then_some(loss + 0.1),
            lr: 3e-4,
            grad_norm: 1.5,
            tokens_per_sec: 1e5,
            tflops_per_device: 12.5,
            mfu: 0.4,
            peak_mem_bytes: Some(1 << 30),
            comm_wait_ms: None,
            comm_device_ms: None,
            host_issue_ms: None,
        }
    }

    #[test]
    fn jsonl_lines_parse_back_and_resume_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/metrics.jsonl");
        let mut log = MetricsLog::create(&path).unwrap();
        for i in 1..=5 {
            log.log(&step(i, 5.0 - i as f64 * 0.1)).unwrap();
        }
        log.log(&step(6, f64::NAN)).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 6);
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert!(v["step"].is_u64() && v.get("mfu").is_some());
        }
        let back = read_metrics(&path).unwrap();
        assert_eq!(
            back[..5],
            (1..=5)
                .map(|i| step(i, 5.0 - i as f64 * 0.1))
                .collect::<Vec<_>>()
        );
        assert!(back[5].loss.is_nan());

        drop(log);
        let mut log = MetricsLog::resume(&path, 3).unwrap();
        log.log(&step(4, 1.0)).unwrap();
        // A torn last line, as a kill during a write leaves.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"step\": 5, \"lo")
            .unwrap();
        let steps: Vec<u64> = read_metrics(&path)
            .unwrap()
            .iter()
            .map(|m| m.step)
            .collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        std::fs::write(&path, "{}\n{\"step\": 1}\n").unwrap();
        assert!(
            read_metrics(&path)
                .unwrap_err()
                .to_string()
                .contains("metrics.jsonl:1")
        );
    }

    #[test]
    fn svg_has_axes_both_series_and_legend() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.svg");
        let train: Vec<(u64, f64)> = (0..5000)
            .map(|i| (i, 8.0 / (1.0 + i as f64 / 100.0)))
            .collect();
        let val = vec![(0, 8.1), (1000, 3.0), (2000, f64::NAN), (4999, 2.2)];
        write_loss_plot_svg(&path, &train, &val, "Llama <tiny> & friends").unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(TRAIN_COLOUR) && svg.contains(VAL_COLOUR));
        assert!(svg.contains(">train<") && svg.contains(">validation<"));
        assert!(svg.contains("&lt;tiny&gt; &amp; friends"));
        assert!(svg.contains(">4000<"), "x ticks");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert_eq!(svg.matches('<').count(), svg.matches('>').count());

        write_loss_plot_svg(&path, &[(1, 2.0)], &[], "one point").unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 1);
        write_loss_plot_svg(&path, &[], &[], "empty").unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("no data"));
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(0.13), 0.2);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(700.0), 1000.0);
        assert_eq!(decimals_for(0.2), 1);
        assert_eq!(decimals_for(5.0), 0);
    }

    /// Names as `cuDeviceGetName` reports them find their GPU's row, variants before their
    /// family and whole words only.
    #[test]
    fn peak_table_matches_device_names() {
        for (name, peak) in [
            ("NVIDIA H200", 989.4e12),
            ("NVIDIA H200 NVL", 835.5e12),
            ("NVIDIA H100 80GB HBM3", 989.4e12),
            ("NVIDIA H100 PCIe", 756e12),
            ("NVIDIA H100 NVL", 835.5e12),
            ("NVIDIA GH200 480GB", 989.4e12),
            ("NVIDIA H20", 148e12),
            ("NVIDIA A100-SXM4-80GB", 312e12),
            ("NVIDIA A100-PCIE-40GB", 312e12),
            ("NVIDIA A100 80GB PCIe", 312e12),
            ("NVIDIA A10G", 70e12),
            ("NVIDIA A10", 125e12),
            ("NVIDIA L4", 121e12),
            ("NVIDIA L40S", 362.05e12),
            ("NVIDIA B200", 2.25e15),
            ("NVIDIA GB200", 2.5e15),
            ("NVIDIA GeForce RTX 4090", 165.2e12),
        ] {
            assert_eq!(device_peak_flops(name), Some(peak), "{name}");
        }
        for unknown in [
            "NVIDIA GeForce GTX 1080",
            "Tesla V100-SXM2-16GB",
            "NVIDIA A2",
            "",
        ] {
            assert_eq!(device_peak_flops(unknown), None, "{unknown}");
        }
    }

    /// The override wins; without it f32 compute and an unknown GPU give no MFU, with a
    /// message that names the GPU and the flag.
    #[test]
    fn mfu_peak_comes_from_the_device_or_the_override() {
        let bf16 = Precision::Bf16;
        assert_eq!(
            mfu_peak_flops(Some("NVIDIA H200"), bf16, None),
            Ok(989.4e12)
        );
        assert_eq!(
            mfu_peak_flops(Some("NVIDIA H200"), bf16, Some(500.0)),
            Ok(500e12)
        );
        assert_eq!(
            mfu_peak_flops(Some("Mystery GPU"), bf16, Some(100.0)),
            Ok(100e12)
        );
        let e = mfu_peak_flops(Some("Mystery GPU"), bf16, None).unwrap_err();
        assert!(
            e.contains("\"Mystery GPU\"") && e.contains("--peak-tflops"),
            "{e}"
        );
        let e = mfu_peak_flops(Some("NVIDIA H200"), Precision::F32, None).unwrap_err();
        assert!(e.contains("f32") && e.contains("--peak-tflops"), "{e}");
        assert!(mfu_peak_flops(None, bf16, None).is_err());
    }
}
