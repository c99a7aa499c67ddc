//! The fault state a [`Proxy`](super::Proxy) or [`Link`](super::Link)
//! applies to the traffic through it.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::sync::watch;

use super::Direction;

/// What a proxy or link does with the traffic through it right now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct State {
    /// Bumped by `drop_all` and `down`: connections from an older epoch are cut.
    pub(super) epoch: u64,
    /// Forward nothing (held back until `heal`).
    pub(super) black_hole: bool,
    /// Forward nothing in one direction, `[to server, to client]` (held
    /// back until passed again).
    pub(super) held: [bool; 2],
    /// Refuse new connections (calls), until `up`.
    pub(super) down: bool,
    /// The proxy was dropped: everything closes (never set on a link).
    pub(super) closed: bool,
    /// Delay of every connection per direction: `[to server, to client]`.
    pub(super) delay: [Duration; 2],
    /// Per-connection overrides, by accept order and direction.
    pub(super) connection_delay: BTreeMap<(usize, Direction), Duration>,
}

impl State {
    pub(super) fn delay(&self, connection: usize, direction: Direction) -> Duration {
        self.connection_delay
            .get(&(connection, direction))
            .copied()
            .unwrap_or(self.delay[direction.index()])
    }
}

/// What a connection should do, given the state.
enum Verdict {
    Forward,
    Stall,
    Cut,
}

fn verdict(state: &State, epoch: u64) -> Verdict {
    if state.closed || state.epoch != epoch {
        Verdict::Cut
    } else if state.black_hole {
        Verdict::Stall
    } else {
        Verdict::Forward
    }
}

/// Waits until the connection may forward; `false` if it must be cut.
pub(super) async fn until_forwarding(state: &mut watch::Receiver<State>, epoch: u64) -> bool {
    loop {
        match verdict(&state.borrow_and_update(), epoch) {
            Verdict::Forward => return true,
            Verdict::Cut => return false,
            Verdict::Stall => {}
        }
        if state.changed().await.is_err() {
            return false;
        }
    }
}

/// As [`until_forwarding`], for bytes travelling in `direction`: also
/// waits while that direction is held.
pub(super) async fn until_passing(
    state: &mut watch::Receiver<State>,
    epoch: u64,
    direction: Direction,
) -> bool {
    loop {
        {
            let now = state.borrow_and_update();
            match verdict(&now, epoch) {
                Verdict::Forward if !now.held[direction.index()] => return true,
                Verdict::Cut => return false,
                Verdict::Forward | Verdict::Stall => {}
            }
        }
        if state.changed().await.is_err() {
            return false;
        }
    }
}

/// Resolves when a connection of `epoch` must be cut.
pub(super) async fn wait_cut(mut state: watch::Receiver<State>, epoch: u64) {
    loop {
        if matches!(verdict(&state.borrow_and_update(), epoch), Verdict::Cut) {
            return;
        }
        if state.changed().await.is_err() {
            return;
        }
    }
}
