//! A backend author's view: cases of one's own beside the shared ones, a
//! server of one's own, outcomes read programmatically — public API only.

use std::sync::{Arc, Mutex};

use distlock_conformance::cases::support::acquire;
use distlock_conformance::cases::{Case, Needs};
use distlock_conformance::{check, CaseOutcome, CaseResult, CaseRun, Suite, TestContext, Variant};
use distlock_core::MemoryLock;

async fn holds_a_key(ctx: TestContext) -> CaseResult {
    let client = ctx.client().await?;
    let key = ctx.key("mine");
    let lease = acquire(&client, &key, ctx.long_ttl(), "my case").await?;
    client.release(&lease).await?;
    Ok(())
}

async fn always_fails(ctx: TestContext) -> CaseResult {
    check!(
        ctx.backend_name() == "nobody",
        "my failing case ran on {}",
        ctx.backend_name()
    );
    Ok(())
}

fn memory_suite(urls: Arc<Mutex<Vec<String>>>) -> Suite {
    let server = MemoryLock::new();
    Suite::new("memory", move |url: String| {
        urls.lock().unwrap().push(url);
        let client = server.client();
        async move { Ok(client) }
    })
}

#[test]
fn own_cases_run_beside_the_shared_ones() {
    let suite = memory_suite(Arc::default())
        .case(Case::new("mine", "holds_a_key", Needs::Nothing, |ctx| {
            Box::pin(holds_a_key(ctx))
        }))
        .case(Case::new("mine", "always_fails", Needs::Nothing, |ctx| {
            Box::pin(always_fails(ctx))
        }))
        .case(Case::new("mine", "needs_a_server", Needs::Server, |ctx| {
            Box::pin(holds_a_key(ctx))
        }));
    let reports = suite.run_cases(&CaseRun {
        only: vec!["mine::".into()],
        ..CaseRun::default()
    });
    let outcomes: Vec<(&str, &CaseOutcome)> = reports
        .iter()
        .map(|r| (r.name.as_str(), &r.outcome))
        .collect();
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    assert_eq!(outcomes[0], ("mine::holds_a_key", &CaseOutcome::Passed));
    assert!(
        matches!(outcomes[1], ("mine::always_fails", CaseOutcome::Failed(m)) if m.contains("ran on memory")),
        "{outcomes:?}"
    );
    assert!(
        matches!(
            outcomes[2],
            ("mine::needs_a_server", CaseOutcome::Ignored(_))
        ),
        "{outcomes:?}"
    );
}

#[test]
fn a_server_of_ones_own_is_given_by_url() {
    let urls = Arc::new(Mutex::new(Vec::new()));
    let reports = memory_suite(urls.clone())
        .external_server("memory://mine")
        .run_cases(&CaseRun {
            only: vec!["basic::acquire_then_release".into()],
            ..CaseRun::default()
        });
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].outcome, CaseOutcome::Passed);
    let urls = urls.lock().unwrap();
    assert!(
        !urls.is_empty() && urls.iter().all(|u| u == "memory://mine"),
        "{urls:?}"
    );
}

#[test]
fn variants_run_every_case_under_their_name_and_a_failed_start_fails_them() {
    let urls = Arc::new(Mutex::new(Vec::new()));
    let stopped = Arc::new(Mutex::new(false));
    /// Marks the group stopped when the harness drops it.
    struct Group(Arc<Mutex<bool>>);
    impl Drop for Group {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = true;
        }
    }
    let group = Group(stopped.clone());
    let reports = memory_suite(urls.clone())
        .variant(Variant::group("up", move || {
            Ok::<_, String>(("memory://up".to_owned(), group))
        }))
        .variant(Variant::group("down", || {
            Err::<(String, ()), _>("no such server binary")
        }))
        .run_cases(&CaseRun {
            only: vec!["basic::acquire_then_release".into()],
            ..CaseRun::default()
        });
    let names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "basic::acquire_then_release",
            "up::basic::acquire_then_release",
            "down::basic::acquire_then_release"
        ]
    );
    assert_eq!(reports[0].outcome, CaseOutcome::Passed);
    assert_eq!(reports[1].outcome, CaseOutcome::Passed);
    assert!(
        matches!(&reports[2].outcome, CaseOutcome::Failed(m) if m.contains("no such server binary")),
        "{:?}",
        reports[2]
    );
    assert!(urls.lock().unwrap().iter().any(|u| u == "memory://up"));
    assert!(*stopped.lock().unwrap(), "the group outlived the run");
}
