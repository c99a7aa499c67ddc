//! Fault injection for the `fault::`, `lease::` and `cancel::` cases: a
//! TCP [`Proxy`] that delays, drops, black-holes or refuses the connections
//! of the clients behind it, its in-process twin [`Link`] for backends
//! without a server process, [`FaultPath`] over both, a lock holder in a
//! child process ([`HolderProcess`]) that can be SIGKILLed, and short
//! client timeouts ([`with_timeouts`]). Server kill, restart, pause
//! (SIGSTOP) and resume are on [`ServerProcess`](crate::server::ServerProcess);
//! a case starts its own with
//! [`TestContext::start_server`](crate::TestContext::start_server) so the
//! shared server other cases use is never disturbed.

pub mod holder;
mod link;
mod proxy;
mod state;

use std::net::SocketAddr;
use std::time::Duration;

pub use self::holder::{HolderProcess, HOLDER_ENV};
pub use self::link::{Link, LINK_SCHEME};
pub use self::proxy::Proxy;

/// Which way bytes (or a simulated request) travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// From the client to the server: requests.
    ToServer,
    /// From the server to the client: replies and notifications.
    ToClient,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::ToServer => 0,
            Direction::ToClient => 1,
        }
    }
}

/// A path between clients and the lock server that a case can delay, cut
/// and black-hole: a TCP [`Proxy`] in front of a server process, or a
/// simulated [`Link`] in front of an in-process backend. Get one with
/// [`TestContext::fault_path`](crate::TestContext::fault_path) and open
/// clients through it with
/// [`TestContext::client_through`](crate::TestContext::client_through);
/// every client opened through one path shares its faults.
#[derive(Debug)]
pub enum FaultPath {
    /// A TCP proxy in front of a server the harness runs.
    Proxy(Proxy),
    /// A simulated network in front of an in-process backend.
    Link(Link),
}

impl FaultPath {
    /// Resets every live connection (in-flight calls fail; a call whose
    /// request was already handled loses its reply).
    pub fn drop_all(&self) {
        match self {
            FaultPath::Proxy(p) => p.drop_all(),
            FaultPath::Link(l) => l.drop_all(),
        }
    }

    /// Forwards nothing either way until [`heal`](Self::heal): calls hang
    /// until their operation timeout.
    pub fn black_hole(&self) {
        match self {
            FaultPath::Proxy(p) => p.black_hole(),
            FaultPath::Link(l) => l.black_hole(),
        }
    }

    /// Ends a black hole; what was held back is delivered late.
    pub fn heal(&self) {
        match self {
            FaultPath::Proxy(p) => p.heal(),
            FaultPath::Link(l) => l.heal(),
        }
    }

    /// Holds back everything travelling in `direction` until
    /// [`pass`](Self::pass), the other direction flowing: with
    /// [`Direction::ToClient`], requests reach the server and are applied
    /// while their replies wait, so each call times out with its outcome
    /// unknown to the client (see [`Proxy::hold`], [`Link::hold`]).
    pub fn hold(&self, direction: Direction) {
        match self {
            FaultPath::Proxy(p) => p.hold(direction),
            FaultPath::Link(l) => l.hold(direction),
        }
    }

    /// Delivers what [`hold`](Self::hold) held back, late, and forwards
    /// again.
    pub fn pass(&self, direction: Direction) {
        match self {
            FaultPath::Proxy(p) => p.pass(direction),
            FaultPath::Link(l) => l.pass(direction),
        }
    }

    /// Delays everything travelling in `direction` by `delay` (zero: none).
    pub fn delay(&self, direction: Direction, delay: Duration) {
        match self {
            FaultPath::Proxy(p) => p.delay(direction, delay),
            FaultPath::Link(l) => l.delay(direction, delay),
        }
    }

    /// The server looks dead: every call fails at once (connection reset or
    /// refused) until [`up`](Self::up).
    pub fn down(&self) {
        match self {
            FaultPath::Proxy(p) => p.down(),
            FaultPath::Link(l) => l.down(),
        }
    }

    /// Resolves once every connection a cut ([`down`](Self::down),
    /// [`drop_all`](Self::drop_all)) ended is closed on the server's side
    /// too (a proxy closes them on their own tasks; a simulated link at
    /// once). Gives up after 10 s.
    pub async fn until_cut_off(&self) {
        if let FaultPath::Proxy(p) = self {
            let give_up = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while p.connections_open() > 0 && std::time::Instant::now() < give_up {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
    }

    /// The server is reachable again after [`down`](Self::down).
    pub fn up(&self) {
        match self {
            FaultPath::Proxy(p) => p.up(),
            FaultPath::Link(l) => l.up(),
        }
    }

    /// The proxy's address, for a proxy.
    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        match self {
            FaultPath::Proxy(p) => Some(p.addr()),
            FaultPath::Link(_) => None,
        }
    }
}

/// `url` with our `connect_timeout_ms` and `operation_timeout_ms` query
/// parameters appended (after `?` or `&`, whichever fits), so a client
/// behind a fault notices it quickly.
///
/// ```
/// use std::time::Duration;
/// use distlock_conformance::fault::with_timeouts;
/// let ms = Duration::from_millis;
/// assert_eq!(
///     with_timeouts("redis://127.0.0.1:1", ms(500), ms(800)),
///     "redis://127.0.0.1:1?connect_timeout_ms=500&operation_timeout_ms=800"
/// );
/// assert_eq!(
///     with_timeouts("redis://h?namespace=x", ms(500), ms(800)),
///     "redis://h?namespace=x&connect_timeout_ms=500&operation_timeout_ms=800"
/// );
/// ```
pub fn with_timeouts(url: &str, connect: Duration, operation: Duration) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!(
        "{url}{separator}connect_timeout_ms={}&operation_timeout_ms={}",
        connect.as_millis(),
        operation.as_millis()
    )
}
