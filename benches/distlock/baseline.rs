//! The floor two targets are held to: the raw driver's acquire write alone
//! and a plain round trip, one task, in interleaved batches. The handoff
//! rows' target (3) is one write plus one round trip; the crowds' rate
//! target (7) is a share of `1 / (hold + write + round trip)`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::plan::{BenchResult, TTL};
use crate::raw::Raw;
use crate::report::{Row, Samples};
use crate::servers::Backend;

/// The raw acquire write alone and a plain round trip, 1 task.
#[derive(Default)]
pub struct Baseline {
    pub acquire: Samples,
    pub ping: Samples,
}

impl Baseline {
    /// `rounds` interleaved rounds of `batch` round trips then `batch` raw
    /// acquire writes (each on a fresh key, released after it is timed),
    /// after one unrecorded round that warms the connections up.
    pub async fn measure(raw: &Raw, batch: usize, rounds: usize) -> BenchResult<Baseline> {
        let mut baseline = Baseline::default();
        for round in 0..=rounds {
            let recorded = (round > 0).then_some(&mut baseline);
            measure_round(raw, batch, recorded).await?;
        }
        Ok(baseline)
    }

    /// One more recorded round, as in [`measure`](Self::measure) (no
    /// warm-up: the connections are in use already).
    pub async fn add_round(&mut self, raw: &Raw, batch: usize) -> BenchResult<()> {
        measure_round(raw, batch, Some(self)).await
    }

    pub fn ping_p50(&self) -> Option<f64> {
        self.ping.pct(0.5)
    }

    /// Raw acquire write p50 plus round trip p50, in µs: the handoff
    /// target (the wake notice and one write).
    pub fn write_plus_round_trip(&self) -> Option<f64> {
        self.acquire
            .pct(0.5)
            .zip(self.ping_p50())
            .map(|(a, p)| a + p)
    }

    /// The row showing it: the write's p50 and p99, in round trips; the
    /// caller writes its note.
    pub fn row(&self, backend: Backend, scenario: &'static str) -> Row {
        let mut row = Row::new(backend, scenario, "1 task");
        row.p50_us = self.acquire.pct(0.5);
        row.p99_us = self.acquire.pct(0.99);
        row.round_trips = self
            .acquire
            .pct(0.5)
            .zip(self.ping_p50())
            .map(|(a, p)| a / p);
        row
    }

    /// `1 / (hold + raw acquire write p50 + round trip p50)`, per second.
    pub fn rate_bound(&self, hold: Duration) -> Option<f64> {
        let floor = self.write_plus_round_trip()?;
        Some(1.0 / (hold.as_secs_f64() + floor / 1e6))
    }
}

async fn measure_round(
    raw: &Raw,
    batch: usize,
    mut recorded: Option<&mut Baseline>,
) -> BenchResult<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    for _ in 0..batch {
        let t = std::time::Instant::now();
        raw.ping().await?;
        if let Some(b) = recorded.as_deref_mut() {
            b.ping.push(t.elapsed());
        }
    }
    for _ in 0..batch {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let (held, took) = raw.acquire(&format!("baseline-raw-{n}"), n, TTL).await?;
        raw.release(held).await?;
        if let Some(b) = recorded.as_deref_mut() {
            b.acquire.push(took);
        }
    }
    Ok(())
}
