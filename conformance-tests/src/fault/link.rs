//! A simulated network in front of an in-process backend: the [`Proxy`]'s
//! faults for backends that have no server process to put a proxy before.
//!
//! [`Proxy`]: super::Proxy

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use distlock_core::{
    AcquireReply, AcquireRequest, Capabilities, Departure, ExtendReply, HeldLock, LockAdmin,
    LockBackend, LockClient, LockError, LockKey, LockState, OwnerToken, PermitReply, PermitRequest,
    PermitState, ReleaseNotifier, ReleaseReply, ReleaseWatch, SemaphoreBackend,
};
use tokio::sync::watch;

use super::state::{until_passing, wait_cut, State};
use super::Direction;

/// The URL scheme of a link: `link://<id>`, optionally followed by the
/// suite's `?operation_timeout_ms=N` (default 5000, as the backends').
pub const LINK_SCHEME: &str = "link://";

/// The operation timeout of a client whose link URL does not set one.
const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// Every link alive, by id, so a client factory can find one by URL.
static LINKS: Mutex<BTreeMap<u64, Weak<Shared>>> = Mutex::new(BTreeMap::new());

/// A simulated network between clients and an in-process lock server.
///
/// Each call a client makes through it is a request and a reply that can be
/// delayed ([`delay`](Self::delay), per direction, or per client with
/// [`delay_connection`](Self::delay_connection)), held back
/// ([`black_hole`](Self::black_hole) until [`heal`](Self::heal), or one
/// direction only with [`hold`](Self::hold) until [`pass`](Self::pass)), cut
/// ([`drop_all`](Self::drop_all): a call whose request was handled loses
/// its reply) or refused ([`down`](Self::down) until [`up`](Self::up)), as
/// the TCP [`Proxy`](super::Proxy) does to a server's clients. A call
/// without a reply within the client's operation timeout fails with
/// `Timeout`; a cut or refused one with `Unavailable`. A request still held
/// back when its caller gives up is never delivered. Release notifications
/// to waiters are delayed and held back like replies, but never lost.
///
/// An in-process backend opts in by wrapping each client its factory opens
/// with [`Link::attach`] and declaring it with
/// [`Suite::simulated_network`](crate::Suite::simulated_network); the suite
/// then hands the factory `link://` URLs for the clients of fault cases.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use distlock_conformance::fault::{Direction, Link};
/// use distlock_core::{ErrorKind, LockKey, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), distlock_core::LockError> {
/// let server = MemoryLock::new();
/// let link = Link::new();
/// let client = Link::attach(&link.url(), server.client())?;
/// let key = LockKey::new("job")?;
/// link.delay(Direction::ToClient, Duration::from_millis(10)); // slow replies
/// let lease = client.try_acquire(&key, Duration::from_secs(5)).await?.lease().unwrap();
/// link.down();
/// let refused = client.release(&lease).await.unwrap_err();
/// assert_eq!(refused.kind(), ErrorKind::Unavailable);
/// link.up();
/// client.release(&lease).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Link {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    id: u64,
    state: watch::Sender<State>,
    attached: AtomicUsize,
    /// Requests that set off across the link, by call name.
    requests: Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for Link {
    fn default() -> Self {
        Self::new()
    }
}

impl Link {
    /// A new link that forwards everything at once.
    pub fn new() -> Link {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(Shared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            state: watch::channel(State::default()).0,
            attached: AtomicUsize::new(0),
            requests: Mutex::new(BTreeMap::new()),
        });
        let mut links = LINKS.lock().unwrap_or_else(|e| e.into_inner());
        links.retain(|_, link| link.strong_count() > 0);
        links.insert(shared.id, Arc::downgrade(&shared));
        Link { shared }
    }

    /// The URL naming this link, `link://<id>`.
    pub fn url(&self) -> String {
        format!("{LINK_SCHEME}{}", self.shared.id)
    }

    /// How many clients were attached to it so far (the index of the next
    /// one, for [`delay_connection`](Self::delay_connection)).
    pub fn clients_attached(&self) -> usize {
        self.shared.attached.load(Ordering::SeqCst)
    }

    /// `client` behind the link `url` names, if `url` is a link URL;
    /// `client` itself for any other URL (a plain client). A `link://` URL
    /// of a link that no longer exists is a `Config` error.
    pub fn attach(url: &str, client: LockClient) -> Result<LockClient, LockError> {
        let Some(rest) = url.strip_prefix(LINK_SCHEME) else {
            return Ok(client);
        };
        let (id, query) = rest.split_once('?').unwrap_or((rest, ""));
        let link = id
            .parse::<u64>()
            .ok()
            .and_then(|id| {
                let links = LINKS.lock().unwrap_or_else(|e| e.into_inner());
                links.get(&id).and_then(Weak::upgrade)
            })
            .ok_or_else(|| {
                LockError::config(format!(
                    "{url:?} names no live link; create one with Link::new and use its url()"
                ))
            })?;
        let mut timeout = DEFAULT_OPERATION_TIMEOUT;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("operation_timeout_ms", ms)) => {
                    let ms = ms.parse::<u64>().map_err(|e| {
                        LockError::config(format!("{url:?}: bad operation_timeout_ms: {e}"))
                    })?;
                    timeout = Duration::from_millis(ms);
                }
                // The suite's URLs carry a connect timeout too; a call
                // through a link has no connection to set up.
                Some(("connect_timeout_ms", _)) => {}
                _ => {
                    return Err(LockError::config(format!(
                        "{url:?}: unknown link parameter {pair:?}"
                    )))
                }
            }
        }
        Ok(Link { shared: link }.wrap(client, timeout))
    }

    /// `client` — of any backend, in-process or not — behind this link,
    /// with calls timing out after `operation_timeout`. With no fault set,
    /// the link is a transparent hop that counts what it carries
    /// ([`requests`](Self::requests)).
    pub fn wrap(&self, client: LockClient, operation_timeout: Duration) -> LockClient {
        let index = self.shared.attached.fetch_add(1, Ordering::SeqCst);
        LockClient::new(LinkedLock {
            link: self.shared.clone(),
            index,
            inner: client.backend().clone(),
            timeout: operation_timeout,
            notifier: ReleaseNotifier::new(),
            permit_notifier: ReleaseNotifier::new(),
        })
    }

    /// How many requests of `call` set off across the link so far: the raw
    /// backend's `"try_acquire"` (an acquire without renewal),
    /// `"try_acquire_renewing"`, `"extend"`, `"release"`, `"watch"`,
    /// `"inspect"`, `"force_release"`.
    pub fn requests(&self, call: &str) -> u64 {
        let requests = self
            .shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        requests.get(call).copied().unwrap_or(0)
    }

    /// Cuts every call in flight (see the type's docs); new calls work.
    pub fn drop_all(&self) {
        self.shared.state.send_modify(|s| s.epoch += 1);
    }

    /// Holds every request and reply back until [`heal`](Self::heal).
    pub fn black_hole(&self) {
        self.shared.state.send_modify(|s| s.black_hole = true);
    }

    /// Delivers what a [`black_hole`](Self::black_hole) held back, late.
    pub fn heal(&self) {
        self.shared.state.send_modify(|s| s.black_hole = false);
    }

    /// Holds back everything travelling in `direction` until
    /// [`pass`](Self::pass); the other direction flows. With
    /// [`Direction::ToClient`]: every call's request reaches the server and
    /// is applied, but its reply (and every release notification) waits, so
    /// the caller sees a `Timeout` after its operation timeout although the
    /// server acted: the outcome is unknown to the client. A reply whose
    /// caller gave up is dropped when passed.
    pub fn hold(&self, direction: Direction) {
        self.shared
            .state
            .send_modify(|s| s.held[direction.index()] = true);
    }

    /// Delivers what [`hold`](Self::hold) held back in `direction`, late,
    /// and forwards again.
    pub fn pass(&self, direction: Direction) {
        self.shared
            .state
            .send_modify(|s| s.held[direction.index()] = false);
    }

    /// Delays every request ([`Direction::ToServer`]) or reply and
    /// notification ([`Direction::ToClient`]) by `delay`, for every client
    /// without a delay of its own.
    pub fn delay(&self, direction: Direction, delay: Duration) {
        self.shared
            .state
            .send_modify(|s| s.delay[direction.index()] = delay);
    }

    /// As [`delay`](Self::delay), for the `client`-th client attached (from
    /// 0) only.
    pub fn delay_connection(&self, client: usize, direction: Direction, delay: Duration) {
        self.shared.state.send_modify(|s| {
            s.connection_delay.insert((client, direction), delay);
        });
    }

    /// The server looks dead: calls in flight are cut and new ones refused
    /// (`Unavailable`) until [`up`](Self::up).
    pub fn down(&self) {
        self.shared.state.send_modify(|s| {
            s.down = true;
            s.epoch += 1;
        });
    }

    /// Calls are accepted again after [`down`](Self::down).
    pub fn up(&self) {
        self.shared.state.send_modify(|s| s.down = false);
    }
}

/// One client behind a link.
struct LinkedLock {
    link: Arc<Shared>,
    index: usize,
    inner: Arc<dyn LockBackend>,
    timeout: Duration,
    /// Local fan-out of the notifications that crossed the link.
    notifier: ReleaseNotifier,
    /// The same for returned semaphore permits.
    permit_notifier: ReleaseNotifier,
}

impl fmt::Debug for LinkedLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinkedLock")
            .field("link", &self.link.id)
            .field("client", &self.index)
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl LinkedLock {
    /// Runs `op` as the server's handling of one request: after the request
    /// crossed the link, and before the reply crosses back.
    async fn call<T>(
        &self,
        what: &'static str,
        op: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        *self
            .link
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(what)
            .or_default() += 1;
        match tokio::time::timeout(self.timeout, self.exchange(what, op)).await {
            Ok(result) => result,
            Err(_) => Err(LockError::timeout(format!(
                "{what}: no reply within {:?} (simulated network)",
                self.timeout
            ))),
        }
    }

    async fn exchange<T>(
        &self,
        what: &str,
        op: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let epoch = {
            let state = self.link.state.borrow();
            if state.down {
                return Err(LockError::unavailable(format!(
                    "{what}: connection refused (simulated network is down)"
                )));
            }
            state.epoch
        };
        if !travel(&self.link, self.index, Direction::ToServer, epoch).await {
            return Err(LockError::unavailable(format!(
                "{what}: connection reset before the request arrived (simulated network)"
            )));
        }
        let result = op.await;
        if !travel(&self.link, self.index, Direction::ToClient, epoch).await {
            return Err(LockError::unavailable(format!(
                "{what}: connection reset; the reply was lost (simulated network)"
            )));
        }
        result
    }
}

/// One crossing of the link: its delay, then any black hole or hold of
/// `direction`. `false` if the connection was cut meanwhile.
async fn travel(link: &Shared, index: usize, direction: Direction, epoch: u64) -> bool {
    let mut state = link.state.subscribe();
    let delay = state.borrow_and_update().delay(index, direction);
    if !delay.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = wait_cut(state.clone(), epoch) => return false,
        }
    }
    until_passing(&mut state, epoch, direction).await
}

/// How long the leave of a closed watch may take to cross the link (a
/// hold or black hole that outlasts it counts as a cut connection, which
/// the server notices: the waiter leaves its line then).
const LEAVE_BOUND: Duration = DEFAULT_OPERATION_TIMEOUT;

/// One waiter's watch across the link.
struct Forwarding {
    link: Arc<Shared>,
    index: usize,
    notifier: ReleaseNotifier,
    /// The waiter's local channel.
    key: String,
}

impl Forwarding {
    /// Passes the inner client's release notifications for the waiter
    /// across the link (delayed, held back by black holes and while down,
    /// never lost) until it has no local watch; then its leave crosses
    /// the link (as a request does: delayed, held back, at most
    /// [`LEAVE_BOUND`]), the inner watch closes, and `departure` ends.
    async fn run(
        self,
        mut inner: ReleaseWatch,
        closed: impl Future<Output = ()>,
        departure: Departure,
    ) {
        tokio::pin!(closed);
        loop {
            tokio::select! {
                _ = &mut closed => break,
                woke = inner.released() => if woke.is_err() { break },
            }
            loop {
                let delivered = match self.epoch() {
                    Some(epoch) => travel(&self.link, self.index, Direction::ToClient, epoch).await,
                    None => {
                        let mut state = self.link.state.subscribe();
                        let _ = state.wait_for(|s| !s.down).await;
                        false
                    }
                };
                if delivered {
                    break;
                }
            }
            self.notifier.notify(&self.key);
        }
        if let Some(epoch) = self.epoch() {
            let leave = travel(&self.link, self.index, Direction::ToServer, epoch);
            let _ = tokio::time::timeout(LEAVE_BOUND, leave).await;
        }
        inner.close(LEAVE_BOUND).await;
        drop(departure);
    }

    /// The link's connection epoch, or `None` while it is down.
    fn epoch(&self) -> Option<u64> {
        let state = self.link.state.borrow();
        (!state.down).then_some(state.epoch)
    }
}

#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl LockBackend for LinkedLock {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<AcquireReply, LockError> {
        let what = if request.renewing {
            "try_acquire_renewing"
        } else {
            "try_acquire"
        };
        self.call(what, self.inner.acquire(request)).await
    }

    async fn extend(&self, lock: HeldLock<'_>, ttl: Duration) -> Result<ExtendReply, LockError> {
        self.call("extend", self.inner.extend(lock, ttl)).await
    }

    /// One request across the link, counted as one `extend`.
    async fn extend_many(
        &self,
        locks: &[HeldLock<'_>],
        ttl: Duration,
    ) -> Result<Vec<Result<ExtendReply, LockError>>, LockError> {
        self.call("extend", self.inner.extend_many(locks, ttl))
            .await
    }

    async fn release(&self, lock: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        self.call("release", self.inner.release(lock)).await
    }

    async fn watch(
        &self,
        key: &LockKey,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let inner = self.call("watch", self.inner.watch(key, waiter)).await?;
        self.forwarded(&self.notifier, key, waiter, inner).await
    }

    fn admin(&self) -> Option<&dyn LockAdmin> {
        self.inner.admin().map(|_| self as &dyn LockAdmin)
    }

    fn semaphore(&self) -> Option<&dyn SemaphoreBackend> {
        self.inner
            .semaphore()
            .map(|_| self as &dyn SemaphoreBackend)
    }
}

impl LinkedLock {
    /// A local watch fed by `inner` across the link, through `notifier`:
    /// one forwarder per waiter, as the backend may wake each alone.
    async fn forwarded(
        &self,
        notifier: &ReleaseNotifier,
        key: &LockKey,
        waiter: OwnerToken,
        inner: Option<ReleaseWatch>,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let Some(inner) = inner else {
            return Ok(None);
        };
        let channel = format!("{}/{}", key.as_str(), waiter.to_hex());
        let mut created = false;
        let mut watch = notifier
            .subscribe(&channel, || {
                created = true;
                async { Ok(()) }
            })
            .await?;
        if created {
            // The channel is this waiter's alone: its inner watch is
            // dropped with it (the backend learns the wait ended), after
            // the leave crossed the link; a closing wait waits for that,
            // as for a real backend's leave request.
            let departure = watch.departure();
            let closed = notifier.closed(&channel);
            let forwarding = Forwarding {
                link: self.link.clone(),
                index: self.index,
                notifier: notifier.clone(),
                key: channel,
            };
            tokio::spawn(forwarding.run(inner, closed, departure));
        }
        Ok(Some(watch))
    }

    fn inner_semaphore(&self) -> Result<&dyn SemaphoreBackend, LockError> {
        self.inner
            .semaphore()
            .ok_or_else(|| LockError::unsupported("the backend behind this link has no semaphores"))
    }
}

#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl SemaphoreBackend for LinkedLock {
    async fn acquire_permit(&self, request: PermitRequest<'_>) -> Result<PermitReply, LockError> {
        let semaphore = self.inner_semaphore()?;
        self.call("acquire_permit", semaphore.acquire_permit(request))
            .await
    }

    async fn extend_permit(
        &self,
        permit: HeldLock<'_>,
        ttl: Duration,
    ) -> Result<ExtendReply, LockError> {
        let semaphore = self.inner_semaphore()?;
        self.call("extend_permit", semaphore.extend_permit(permit, ttl))
            .await
    }

    async fn release_permit(&self, permit: HeldLock<'_>) -> Result<ReleaseReply, LockError> {
        let semaphore = self.inner_semaphore()?;
        self.call("release_permit", semaphore.release_permit(permit))
            .await
    }

    async fn watch_permits(
        &self,
        key: &LockKey,
        limit: u32,
        waiter: OwnerToken,
    ) -> Result<Option<ReleaseWatch>, LockError> {
        let semaphore = self.inner_semaphore()?;
        let inner = self
            .call("watch_permits", semaphore.watch_permits(key, limit, waiter))
            .await?;
        self.forwarded(&self.permit_notifier, key, waiter, inner)
            .await
    }
}

/// Every call, provided ones too, crosses the link.
#[deny(clippy::missing_trait_methods)]
#[distlock_core::async_trait]
impl LockAdmin for LinkedLock {
    async fn inspect(&self, key: &LockKey) -> Result<LockState, LockError> {
        let admin = self.inner.admin().ok_or_else(no_admin)?;
        self.call("inspect", admin.inspect(key)).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let admin = self.inner.admin().ok_or_else(no_admin)?;
        self.call("force_release", admin.force_release(key)).await
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<Option<ReleaseWatch>, LockError> {
        let admin = self.inner.admin().ok_or_else(no_admin)?;
        self.call("watch_holder", admin.watch_holder(key)).await
    }

    async fn inspect_permits(&self, key: &LockKey) -> Result<Vec<PermitState>, LockError> {
        let admin = self.inner.admin().ok_or_else(no_admin)?;
        self.call("inspect_permits", admin.inspect_permits(key))
            .await
    }
}

fn no_admin() -> LockError {
    LockError::unsupported("the backend behind this link has no operator calls")
}

#[cfg(test)]
mod tests {
    use distlock_core::{ErrorKind, MemoryLock};

    use super::*;

    #[tokio::test]
    async fn black_holes_cuts_and_counts_calls() {
        let server = MemoryLock::new();
        let link = Link::new();
        let url = format!("{}?operation_timeout_ms=100", link.url());
        let client = Link::attach(&url, server.client()).unwrap();
        let key = LockKey::new("link-test").unwrap();

        // Held back until the client's operation timeout: Timeout, and the
        // request was never handled.
        link.black_hole();
        let lost = client.try_acquire(&key, Duration::from_secs(5)).await;
        assert_eq!(lost.unwrap_err().kind(), ErrorKind::Timeout);
        link.heal();
        assert_eq!(server.held_count(), 0);

        // A cut while the reply travels: handled, but the reply is lost.
        link.delay(Direction::ToClient, Duration::from_secs(3600));
        let call = {
            let (client, key) = (client.clone(), key.clone());
            tokio::spawn(async move { client.try_acquire(&key, Duration::from_secs(5)).await })
        };
        while server.held_count() == 0 {
            tokio::task::yield_now().await;
        }
        link.drop_all();
        let cut = call.await.unwrap();
        assert_eq!(cut.unwrap_err().kind(), ErrorKind::Unavailable);
        assert_eq!(link.requests("try_acquire"), 2);
        assert_eq!(link.requests("extend"), 0);

        // Any other URL leaves the client as it is; a stale link URL is a
        // configuration error.
        assert!(Link::attach("", server.client()).is_ok());
        let stale = Link::attach("link://0", server.client()).unwrap_err();
        assert_eq!(stale.kind(), ErrorKind::Config);
    }

    /// A waiter's leave is a request like any other: it crosses the link
    /// (here held back on its way), the waiter keeps its place in the
    /// server's line until it arrives, and closing the watch returns only
    /// then. The link used to drop the inner watch in-process as soon as
    /// its forwarder ran, whatever the link did to requests, so a wait
    /// could return before its leave was done (or, on a loaded machine,
    /// long before the forwarder ran: the suite's
    /// `handoff::a_timed_out_wait_gives_up_its_place` then failed on the
    /// in-process control).
    #[tokio::test]
    async fn a_closed_watchs_leave_crosses_the_link() {
        let server = MemoryLock::new();
        let link = Link::new();
        let waiter = Link::attach(&link.url(), server.client()).unwrap();
        let (holder, other) = (server.client(), server.client());
        let key = LockKey::new("link-leave").unwrap();
        let ttl = Duration::from_secs(60);
        let lease = holder.try_acquire(&key, ttl).await.unwrap();
        let lease = lease.lease().expect("a free key").clone();
        let owner = OwnerToken::random();
        let watch = waiter.backend().watch(&key, owner).await.unwrap();
        let watch = watch.expect("the memory backend wakes waiters");
        let request = AcquireRequest {
            key: &key,
            owner,
            ttl,
            renewing: false,
            settling: false,
            holder: None,
        };
        let refused = waiter.backend().acquire(request).await.unwrap();
        assert!(matches!(refused, AcquireReply::Held { .. }), "{refused:?}");

        link.hold(Direction::ToServer);
        let closing = tokio::spawn(watch.close(Duration::from_secs(3600)));
        // Not a synchronisation: time for the forwarder to run, so that a
        // leave that ignores the link is done by now.
        tokio::time::sleep(Duration::from_millis(100)).await;
        holder.release(&lease).await.unwrap();
        let cut_in = other.try_acquire(&key, ttl).await.unwrap();
        assert!(
            cut_in.lease().is_none(),
            "the waiter left its line before its leave crossed the link"
        );
        assert!(
            !closing.is_finished(),
            "the close returned before the leave arrived"
        );

        link.pass(Direction::ToServer);
        closing.await.unwrap();
        let taken = other.try_acquire(&key, ttl).await.unwrap();
        assert!(
            taken.lease().is_some(),
            "the key stayed with the departed waiter's turn"
        );
    }
}
