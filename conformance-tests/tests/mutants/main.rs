//! The suite's mutation score: the whole memory suite runs against every
//! mutant of [`corpus::CORPUS`] (a `MemoryLock` wrapper with one defect),
//! and each mutant is a test that passes only if some case rejects it. A
//! control with no defect must pass every case (so a rejection is the
//! defect's doing, not the wrapper's or the machine's).
//!
//! Each mutant's expected killers run first and the run stops at the first
//! failing case; a mutant they miss still meets the rest of the suite
//! before it is declared a survivor. `DISTLOCK_MUTANTS_SKIP=a,b` leaves
//! out cases whose name contains `a` or `b` (to see what a mutant survives
//! without them).

mod corpus;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use distlock_conformance::fault::Link;
use distlock_conformance::{namespace_of, CaseOutcome, CaseRun, Suite};
use distlock_core::{LockClient, MemoryLock};
use libtest_mimic::{Arguments, Failed, Trial};

use corpus::{Defect, Mutant, MutantSpec, CORPUS};

/// Mutants evaluated at once (each runs its cases on its own threads).
const PARALLEL_MUTANTS: usize = 8;
/// Cases run at once per mutant.
const CASE_THREADS: usize = 6;
/// The exclusion torture's length under the mutants (seconds).
const TORTURE_SECS: &str = "5";

/// Mutants evaluated and rejected in this run (for the score line).
static EVALUATED: AtomicUsize = AtomicUsize::new(0);
static REJECTED: AtomicUsize = AtomicUsize::new(0);

fn suite(name: &str, defect: Defect) -> Suite {
    // One in-memory server per namespace, as the memory target has.
    let servers = Arc::new(Mutex::new(HashMap::<String, MemoryLock>::new()));
    Suite::new(name, move |url: String| {
        let namespace = match corpus::shares_namespaces(defect) {
            true => "",
            false => namespace_of(&url).unwrap_or_default(),
        };
        let client: LockClient = servers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(namespace.to_owned())
            .or_default()
            .client();
        async move {
            if defect.below_link() {
                Link::attach(&url, Mutant::wrap(defect, client))
            } else {
                Ok(Mutant::wrap(defect, Link::attach(&url, client)?))
            }
        }
    })
    .simulated_network()
    .namespaces()
}

fn skipped() -> Vec<String> {
    std::env::var("DISTLOCK_MUTANTS_SKIP")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Passes if some case rejects the mutant.
fn reject(spec: MutantSpec) -> Result<(), Failed> {
    let run = CaseRun {
        threads: CASE_THREADS,
        first: spec.killers.iter().map(|k| k.to_string()).collect(),
        stop_at_first_failure: true,
        skip: skipped(),
        ..CaseRun::default()
    };
    let reports = suite(&format!("mutant-{}", spec.name), spec.defect).run_cases(&run);
    EVALUATED.fetch_add(1, Ordering::SeqCst);
    match reports.iter().find_map(|r| match &r.outcome {
        CaseOutcome::Failed(message) => Some((&r.name, message)),
        _ => None,
    }) {
        Some((case, message)) => {
            let expected = if spec.killers.contains(&case.as_str()) {
                ""
            } else {
                " (not one of its expected killers)"
            };
            let first_line = message.lines().next().unwrap_or_default();
            println!(
                "mutant {} rejected by {case}{expected}: {first_line}",
                spec.name
            );
            REJECTED.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        None => Err(Failed::from(format!(
            "mutant `{}` passed all {} cases: the suite does not catch this defect: {}",
            spec.name,
            reports.len(),
            spec.what
        ))),
    }
}

/// Passes if the wrapper without a defect passes every case.
fn control() -> Result<(), Failed> {
    let run = CaseRun {
        threads: CASE_THREADS,
        skip: skipped(),
        ..CaseRun::default()
    };
    let failures: Vec<String> = suite("mutant-control", Defect::None)
        .run_cases(&run)
        .into_iter()
        .filter_map(|r| match r.outcome {
            CaseOutcome::Failed(message) => Some(format!("{}: {message}", r.name)),
            _ => None,
        })
        .collect();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Failed::from(format!(
            "the control (no defect) failed, so rejections prove nothing:\n{}",
            failures.join("\n")
        )))
    }
}

fn main() -> ExitCode {
    if std::env::var_os("DISTLOCK_TORTURE_SECS").is_none() {
        // Set before any case runs (no thread reads the environment yet).
        std::env::set_var("DISTLOCK_TORTURE_SECS", TORTURE_SECS);
    }
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        args.test_threads = Some(PARALLEL_MUTANTS);
    }
    let mut trials = vec![Trial::test("control::no_defect", control)];
    trials.extend(
        CORPUS
            .iter()
            .map(|spec| Trial::test(format!("mutant::{}", spec.name), move || reject(*spec))),
    );
    let conclusion = libtest_mimic::run(&args, trials);
    let evaluated = EVALUATED.load(Ordering::SeqCst);
    if evaluated > 0 {
        println!(
            "mutation score: {}/{evaluated} mutants rejected ({} in the corpus)",
            REJECTED.load(Ordering::SeqCst),
            CORPUS.len()
        );
    }
    conclusion.exit_code()
}
