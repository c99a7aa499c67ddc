//! Results: latency samples, output rows, the printed table and the JSON.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::{json, Value};

use crate::servers::Backend;

/// One output row.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub backend: &'static str,
    pub scenario: &'static str,
    pub param: String,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub ops_per_s: Option<f64>,
    pub ratio_vs_raw: Option<f64>,
    pub round_trips: Option<f64>,
    pub note: Option<String>,
    /// Fields of this row's own, added to its JSON object (the peer row's
    /// mean, the state row's key counts).
    pub extra: Vec<(&'static str, Value)>,
    /// Issue 28's targets judged on this row, by name: met or not (the
    /// JSON's `targets`).
    pub targets: serde_json::Map<String, Value>,
}

impl Row {
    pub fn new(backend: Backend, scenario: &'static str, param: impl Into<String>) -> Self {
        Row {
            backend: backend.name(),
            scenario,
            param: param.into(),
            ..Row::default()
        }
    }

    /// Judges one of issue 28's targets on this row: `what` (the target's
    /// number and the figures compared) goes to the note with the verdict,
    /// and `name` to the JSON's `targets`.
    pub fn judge(&mut self, name: &'static str, met: bool, what: impl std::fmt::Display) {
        let verdict = format!("target {what}: {}", if met { "met" } else { "NOT met" });
        self.note = Some(match self.note.take() {
            Some(note) => format!("{note}; {verdict}"),
            None => verdict,
        });
        self.targets.insert(name.to_owned(), json!(met));
    }

    pub fn json(&self) -> Value {
        let mut value = json!({
            "backend": self.backend,
            "scenario": self.scenario,
            "param": self.param,
            "p50_us": self.p50_us.map(round1),
            "p99_us": self.p99_us.map(round1),
            "ops_per_s": self.ops_per_s.map(round1),
            "ratio_vs_raw": self.ratio_vs_raw.map(round3),
            "round_trips": self.round_trips.map(round3),
            "note": self.note,
        });
        if let Value::Object(fields) = &mut value {
            for (name, extra) in &self.extra {
                fields.insert((*name).to_owned(), extra.clone());
            }
            if !self.targets.is_empty() {
                fields.insert("targets".to_owned(), Value::Object(self.targets.clone()));
            }
        }
        value
    }
}

pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Latency samples.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    pub us: Vec<f64>,
    pub ops: usize,
    pub busy: Duration,
    /// CPU ns used by this process / the server during the batches.
    pub client_ns: u64,
    pub server_ns: u64,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.us.push(d.as_secs_f64() * 1e6);
    }

    pub fn merge(&mut self, other: Samples) {
        self.us.extend(other.us);
        self.ops += other.ops;
        self.busy += other.busy;
        self.client_ns += other.client_ns;
        self.server_ns += other.server_ns;
    }

    /// "CPU µs/op client C, server S".
    pub fn cpu_note(&self, server: bool) -> String {
        let per_op = |ns: u64| ns as f64 / 1e3 / self.ops.max(1) as f64;
        if server {
            format!(
                "CPU µs/op: client {:.1}, server {:.1}",
                per_op(self.client_ns),
                per_op(self.server_ns)
            )
        } else {
            format!("CPU µs/op: {:.1}", per_op(self.client_ns))
        }
    }

    pub fn pct(&self, p: f64) -> Option<f64> {
        if self.us.is_empty() {
            return None;
        }
        let mut v = self.us.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        Some(v[i.min(v.len() - 1)])
    }

    pub fn mean(&self) -> Option<f64> {
        (!self.us.is_empty()).then(|| self.us.iter().sum::<f64>() / self.us.len() as f64)
    }

    pub fn ops_per_s(&self) -> Option<f64> {
        (self.busy > Duration::ZERO).then(|| self.ops as f64 / self.busy.as_secs_f64())
    }
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}"))
        .unwrap_or_else(|| "-".to_owned())
}

/// The table printed at the end of a run.
pub fn render(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{:<9} {:<29} {:<9} {:>9} {:>9} {:>10} {:>6} {:>8}  note",
        "backend", "scenario", "param", "p50 µs", "p99 µs", "ops/s", "ratio", "RTs"
    );
    let mut last = "";
    for r in rows {
        if r.backend != last && !last.is_empty() {
            out.push('\n');
        }
        last = r.backend;
        let _ = writeln!(
            out,
            "{:<9} {:<29} {:<9} {:>9} {:>9} {:>10} {:>6} {:>8}  {}",
            r.backend,
            r.scenario,
            r.param,
            fmt_opt(r.p50_us, 1),
            fmt_opt(r.p99_us, 1),
            fmt_opt(r.ops_per_s, 0),
            fmt_opt(r.ratio_vs_raw, 2),
            fmt_opt(r.round_trips, 2),
            r.note.as_deref().unwrap_or("")
        );
    }
    let _ = writeln!(
        out,
        "\nratio = library p50 ÷ raw p50 (1.00 = as fast as the raw commands; the note gives raw ops/s ÷ library ops/s). \
         RTs = p50 ÷ the 1-task round-trip p50 (latency rows), or server commands/requests/statements per handoff or per renewal period. \
         crowd rows: p50/p99 = wait from calling acquire to its return, ops/s = handoffs (acquisitions) per second."
    );
    out
}

/// Writes every row to `target/distlock-bench.json` (or under
/// `CARGO_TARGET_DIR`); the path written.
pub fn write_json(rows: &[Row]) -> Result<std::path::PathBuf, String> {
    let json = Value::Array(rows.iter().map(Row::json).collect());
    let target = std::env::var("CARGO_TARGET_DIR")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target").to_owned());
    let path = std::path::Path::new(&target).join("distlock-bench.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}
