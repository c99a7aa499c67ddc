//! Every case of the suite, by group.

use std::future::Future;
use std::pin::Pin;

use crate::context::{CaseResult, TestContext};

mod basic;

/// What a case needs from the backend beyond the core contract; a case whose
/// need is not met shows as `ignored` with the reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Only the core contract.
    Nothing,
    /// Server-driven wake-up of waiters (`Capabilities::native_wait`).
    NativeWait,
    /// Lock data survives a server restart (`Capabilities::durable`).
    Durable,
    /// A server process the harness controls (kill, restart).
    ServerControl,
}

impl Needs {
    /// Why the case cannot run here, if it cannot.
    pub fn missing(self, context: &TestContext) -> Option<String> {
        let caps = context.capabilities();
        match self {
            Needs::Nothing => None,
            Needs::NativeWait => (!caps.native_wait)
                .then(|| "backend declares no server-driven wake-up (native_wait = false)".into()),
            Needs::Durable => (!caps.durable)
                .then(|| "backend declares its lock data does not survive a restart (durable = false)".into()),
            Needs::ServerControl => context.server().and_then(|s| s.process()).is_none().then(|| {
                "no server process under the harness's control (in-process backend or external server URL)".into()
            }),
        }
    }
}

/// The future a case returns.
pub type CaseFuture = Pin<Box<dyn Future<Output = CaseResult> + Send>>;

/// One conformance case.
#[derive(Clone, Copy)]
pub struct Case {
    /// Its group (`basic`, `input`, ...).
    pub group: &'static str,
    /// Its name within the group.
    pub name: &'static str,
    /// What it needs from the backend.
    pub needs: Needs,
    /// The case itself.
    pub run: fn(TestContext) -> CaseFuture,
}

/// Declares cases of one group module: `cases!(basic: acquire_release, ...)`;
/// a case may carry `=> Needs::X`.
macro_rules! cases {
    ($group:ident : $($name:ident $(=> $needs:expr)?),+ $(,)?) => {
        vec![$(Case {
            group: stringify!($group),
            name: stringify!($name),
            needs: { #[allow(unused_mut, unused_assignments)] let mut n = Needs::Nothing; $(n = $needs;)? n },
            run: |ctx| Box::pin($group::$name(ctx)),
        }),+]
    };
}

/// Every case, in a stable order.
pub fn all() -> Vec<Case> {
    let mut all = Vec::new();
    all.extend(cases!(basic: acquire_then_release, held_key_is_refused));
    all
}
