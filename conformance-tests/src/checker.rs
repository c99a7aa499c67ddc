//! The exclusion checker: records every critical section run under a lock
//! and proves mutual exclusion after the fact.
//!
//! Each section is recorded with its key, its fencing token, and start/end
//! sequence numbers drawn from one global atomic counter, so "A ended before
//! B started" is a fact about the program's order of events, not about
//! clocks. [`ExclusionChecker::verify`] then proves, per key:
//!
//! - no two sections overlap;
//! - fencing tokens strictly grow in the order sections started;
//! - a deliberately non-atomic counter (read, yield, write — a lost update
//!   whenever two sections interleave) lost no increment.
//!
//! For a semaphore of N permits, [`ExclusionChecker::verify_at_most`] proves
//! instead that no more than N sections of a key were open at once, each
//! under a fencing token of its own.
//!
//! ```
//! use distlock_conformance::checker::ExclusionChecker;
//! use distlock_core::{FencingToken, LockKey};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let checker = ExclusionChecker::new();
//! let key = LockKey::new("jobs").unwrap();
//! // ... acquire the lock, then:
//! checker.critical_section(&key, FencingToken::new(1)).await;
//! // ... release; later, another holder:
//! checker.critical_section(&key, FencingToken::new(2)).await;
//! let report = checker.verify().expect("exclusion held");
//! assert_eq!(report.sections, 2);
//! assert_eq!(report.counters[&key], 2);
//! # }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use distlock_core::{FencingToken, LockKey};

/// One recorded critical section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The lock key it ran under.
    pub key: LockKey,
    /// The fencing token of the acquisition it ran under.
    pub token: FencingToken,
    /// Global sequence number taken when the section started.
    pub start: u64,
    /// Global sequence number taken when the section ended.
    pub end: u64,
    /// Whether it incremented the key's non-atomic counter.
    pub incremented: bool,
    /// When it started, by this process's clock.
    pub started_at: Instant,
    /// The holder's stop moment, if the section was ended with
    /// [`SectionHandle::exit_by`]: the job did nothing after it (it was
    /// told to stop then, and a task starved past it only records its exit
    /// late), so a section that starts later does not overlap it.
    pub stop_by: Option<Instant>,
}

impl Section {
    /// Whether this section's job had been told to stop (its stop moment,
    /// see [`SectionHandle::exit_by`]) before `later` started: then they
    /// do not overlap, however late this one's exit was recorded.
    fn stopped_before(&self, later: &Section) -> bool {
        self.stop_by.is_some_and(|stop| later.started_at >= stop)
    }
}

/// What [`ExclusionChecker::verify`] found when everything held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// How many sections were recorded, over all keys.
    pub sections: usize,
    /// Per key: the final value of its non-atomic counter (equal to the
    /// number of incrementing sections on that key).
    pub counters: HashMap<LockKey, u64>,
    /// Per key: how many sections ran on it.
    pub sections_per_key: HashMap<LockKey, usize>,
}

/// What [`ExclusionChecker::verify_at_most`] found when the limit held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitReport {
    /// How many sections were recorded, over all keys.
    pub sections: usize,
    /// Per key: the most sections open at once.
    pub most_at_once: HashMap<LockKey, usize>,
}

/// Records critical sections from many tasks and clients and proves they
/// never overlapped. Share it behind an [`Arc`].
#[derive(Debug, Default)]
pub struct ExclusionChecker {
    seq: AtomicU64,
    sections: Mutex<Vec<Section>>,
    counters: Mutex<HashMap<LockKey, Arc<AtomicU64>>>,
}

/// An open critical section; close it with [`SectionHandle::exit`] while
/// the lock is still held. Dropping it without `exit` records nothing.
#[must_use = "a section is only recorded when exit() is called"]
pub struct SectionHandle<'a> {
    checker: &'a ExclusionChecker,
    key: LockKey,
    token: FencingToken,
    start: u64,
    started_at: Instant,
    incremented: bool,
}

impl fmt::Debug for SectionHandle<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SectionHandle")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("start", &self.start)
            .finish()
    }
}

impl SectionHandle<'_> {
    /// Runs the non-atomic increment of this key's counter: reads it, yields
    /// to the scheduler, writes the read value plus one. Two overlapping
    /// sections doing this lose an update, which [`ExclusionChecker::verify`]
    /// then reports.
    pub async fn increment(&mut self) {
        let counter = self.checker.counter(&self.key);
        let read = counter.load(Ordering::SeqCst);
        tokio::task::yield_now().await;
        counter.store(read + 1, Ordering::SeqCst);
        self.incremented = true;
    }

    /// Ends the section and records it. Call it before releasing the lock.
    pub fn exit(self) {
        self.record(None);
    }

    /// Ends the section of a job that was told to stop at `stop_moment`
    /// (its guard's [`stop_moment`](distlock_core::LockGuard::stop_moment)
    /// when its `lost()` fired): it did nothing after that moment, however
    /// late a starved task records its exit. The checker still reports a
    /// section that started before `stop_moment` while this one ran, so a
    /// stop moment the server's expiry preceded (a wrong lease), or a lock
    /// granted twice, is still caught.
    pub fn exit_by(self, stop_moment: Instant) {
        self.record(Some(stop_moment));
    }

    fn record(self, stop_by: Option<Instant>) {
        let end = self.checker.next_seq();
        let section = Section {
            key: self.key,
            token: self.token,
            start: self.start,
            end,
            incremented: self.incremented,
            started_at: self.started_at,
            stop_by,
        };
        self.checker
            .sections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(section);
    }
}

impl ExclusionChecker {
    /// An empty checker, ready to share.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    fn counter(&self, key: &LockKey) -> Arc<AtomicU64> {
        self.counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_default()
            .clone()
    }

    /// Starts a critical section on `key` under the acquisition `token`.
    /// Call it right after the lock was acquired.
    pub fn enter(&self, key: &LockKey, token: FencingToken) -> SectionHandle<'_> {
        SectionHandle {
            checker: self,
            key: key.clone(),
            token,
            start: self.next_seq(),
            started_at: Instant::now(),
            incremented: false,
        }
    }

    /// The usual section: enter, increment the non-atomic counter, exit.
    pub async fn critical_section(&self, key: &LockKey, token: FencingToken) {
        let mut section = self.enter(key, token);
        section.increment().await;
        section.exit();
    }

    /// Every section recorded so far, in the order they ended.
    pub fn sections(&self) -> Vec<Section> {
        self.sections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Proves exclusion over everything recorded: no overlap per key, tokens
    /// strictly growing in start order per key, no lost increment. Returns a
    /// message naming the first violation otherwise.
    pub fn verify(&self) -> Result<CheckReport, String> {
        self.check(true)
    }

    /// As [`verify`](Self::verify), but without the fencing-token order: for
    /// a server that lost its data in a restart (its token counter starts
    /// over), where only exclusion itself can be proved.
    pub fn verify_exclusion_only(&self) -> Result<CheckReport, String> {
        self.check(false)
    }

    /// Every section recorded so far, per key, in the order they started.
    fn by_key(&self) -> HashMap<LockKey, Vec<Section>> {
        let mut by_key: HashMap<LockKey, Vec<Section>> = HashMap::new();
        for section in self.sections() {
            by_key.entry(section.key.clone()).or_default().push(section);
        }
        for sections in by_key.values_mut() {
            sections.sort_by_key(|s| s.start);
        }
        by_key
    }

    /// Proves a semaphore's limit over everything recorded: per key, never
    /// more than `limit` sections open at once, and no two sections under
    /// one fencing token (every permit granted has its own). Returns a
    /// message naming the first violation otherwise. The guarded counter is
    /// not checked: up to `limit` holders legitimately interleave.
    pub fn verify_at_most(&self, limit: usize) -> Result<LimitReport, String> {
        let mut report = LimitReport {
            sections: 0,
            most_at_once: HashMap::new(),
        };
        for (key, sections) in self.by_key() {
            let mut tokens = HashSet::new();
            let mut open: Vec<&Section> = Vec::new();
            let mut most = 0;
            for section in &sections {
                if !tokens.insert(section.token) {
                    return Err(format!(
                        "key {key:?}: two sections ran under fencing token {} (the second started at #{})",
                        section.token, section.start
                    ));
                }
                // Sequence numbers are unique, so `end < start` is "ended
                // before"; a section past its stop moment had stopped.
                open.retain(|s| s.end > section.start && !s.stopped_before(section));
                open.push(section);
                if open.len() > limit {
                    let held: Vec<String> = open
                        .iter()
                        .map(|s| format!("token {} (#{}..#{})", s.token, s.start, s.end))
                        .collect();
                    return Err(format!(
                        "key {key:?}: {} sections open at once with a limit of {limit}: {}",
                        open.len(),
                        held.join(", ")
                    ));
                }
                most = most.max(open.len());
            }
            report.sections += sections.len();
            report.most_at_once.insert(key, most);
        }
        Ok(report)
    }

    fn check(&self, token_order: bool) -> Result<CheckReport, String> {
        let mut report = CheckReport {
            sections: 0,
            counters: HashMap::new(),
            sections_per_key: HashMap::new(),
        };
        for (key, sections) in self.by_key() {
            let mut latest: Option<&Section> = None;
            // Earlier sections that may still be open (their exit recorded
            // late by a task starved past its stop moment).
            let mut open: Vec<&Section> = Vec::new();
            for section in &sections {
                open.retain(|s| s.end > section.start);
                if let Some(prev) = open.iter().find(|prev| !prev.stopped_before(section)) {
                    return Err(format!(
                        "key {key:?}: critical sections overlap: token {} ran from #{} to #{} and token {} started at #{}{}",
                        prev.token, prev.start, prev.end, section.token, section.start,
                        match prev.stop_by {
                            Some(stop) => format!(", {:?} before the first one's stop moment", stop - section.started_at),
                            None => String::new(),
                        }
                    ));
                }
                if let Some(prev) = latest {
                    if token_order && section.token <= prev.token {
                        return Err(format!(
                            "key {key:?}: fencing token did not grow: section starting at #{} has token {} after token {} (started at #{})",
                            section.start, section.token, prev.token, prev.start
                        ));
                    }
                }
                latest = Some(section);
                open.push(section);
            }
            let increments = sections.iter().filter(|s| s.incremented).count() as u64;
            let counted = self.counter(&key).load(Ordering::SeqCst);
            if counted != increments {
                return Err(format!(
                    "key {key:?}: the guarded counter is {counted} after {increments} increments: {} lost",
                    increments.saturating_sub(counted)
                ));
            }
            report.sections += sections.len();
            report.counters.insert(key.clone(), counted);
            report.sections_per_key.insert(key, sections.len());
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::new(name).unwrap()
    }

    #[tokio::test]
    async fn sequential_sections_pass() {
        let checker = ExclusionChecker::new();
        for i in 1..=5 {
            checker
                .critical_section(&key("a"), FencingToken::new(i))
                .await;
            checker
                .critical_section(&key("b"), FencingToken::new(i * 10))
                .await;
        }
        let report = checker.verify().unwrap();
        assert_eq!(report.sections, 10);
        assert_eq!(report.counters[&key("a")], 5);
    }

    #[tokio::test]
    async fn overlap_is_caught() {
        let checker = ExclusionChecker::new();
        let first = checker.enter(&key("a"), FencingToken::new(1));
        let second = checker.enter(&key("a"), FencingToken::new(2));
        first.exit();
        second.exit();
        assert!(checker.verify().unwrap_err().contains("overlap"));
    }

    /// A section whose exit a starved task recorded late is not an overlap
    /// with one that started after its stop moment, but still is with one
    /// that started before it, and later sections are checked against both.
    #[test]
    fn exit_by_excuses_only_what_started_after_the_stop_moment() {
        let checker = ExclusionChecker::new();
        let stop = Instant::now();
        let first = checker.enter(&key("a"), FencingToken::new(1));
        std::thread::sleep(std::time::Duration::from_millis(2));
        let second = checker.enter(&key("a"), FencingToken::new(2));
        first.exit_by(stop);
        second.exit();
        assert!(checker.verify().is_ok());
        assert!(checker.verify_at_most(1).is_ok());
        // Started before the stop moment: an overlap.
        let checker = ExclusionChecker::new();
        let first = checker.enter(&key("a"), FencingToken::new(1));
        let second = checker.enter(&key("a"), FencingToken::new(2));
        let stop = Instant::now() + std::time::Duration::from_secs(60);
        first.exit_by(stop);
        second.exit();
        let err = checker.verify().unwrap_err();
        assert!(err.contains("before the first one's stop moment"), "{err}");
        assert!(checker.verify_at_most(1).is_err());
        // A third section overlapping the long-open first one is caught
        // although the second started and ended in between.
        let checker = ExclusionChecker::new();
        let stop = Instant::now() + std::time::Duration::from_secs(60);
        let first = checker.enter(&key("a"), FencingToken::new(1));
        let second = checker.enter(&key("a"), FencingToken::new(2));
        let third = checker.enter(&key("a"), FencingToken::new(3));
        first.exit_by(stop);
        second.exit();
        third.exit();
        assert!(checker.verify().is_err());
    }

    #[tokio::test]
    async fn shrinking_token_is_caught() {
        let checker = ExclusionChecker::new();
        checker
            .critical_section(&key("a"), FencingToken::new(2))
            .await;
        checker
            .critical_section(&key("a"), FencingToken::new(2))
            .await;
        assert!(checker.verify().unwrap_err().contains("did not grow"));
    }

    #[test]
    fn limit_reached_passes_and_exceeded_is_caught() {
        let checker = ExclusionChecker::new();
        let a = checker.enter(&key("a"), FencingToken::new(1));
        let b = checker.enter(&key("a"), FencingToken::new(2));
        a.exit();
        let c = checker.enter(&key("a"), FencingToken::new(3));
        b.exit();
        c.exit();
        let report = checker.verify_at_most(2).unwrap();
        assert_eq!(report.sections, 3);
        assert_eq!(report.most_at_once[&key("a")], 2);
        let err = checker.verify_at_most(1).unwrap_err();
        assert!(err.contains("2 sections open at once"), "{err}");
    }

    #[test]
    fn shared_permit_token_is_caught() {
        let checker = ExclusionChecker::new();
        checker.enter(&key("a"), FencingToken::new(7)).exit();
        checker.enter(&key("a"), FencingToken::new(7)).exit();
        assert!(checker.verify_at_most(3).unwrap_err().contains("token 7"));
    }

    #[tokio::test]
    async fn lost_increment_is_caught() {
        let checker = ExclusionChecker::new();
        let counter = checker.counter(&key("a"));
        checker
            .critical_section(&key("a"), FencingToken::new(1))
            .await;
        counter.store(0, Ordering::SeqCst); // an interleaved writer's stale value
        assert!(checker.verify().unwrap_err().contains("lost"));
    }
}
