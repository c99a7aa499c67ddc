//! A loopback TCP proxy that can delay, cut and refuse the connections
//! through it.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::state::{until_forwarding, until_passing, wait_cut, State};
use super::Direction;

/// A TCP proxy on `127.0.0.1:<free port>` in front of one server address,
/// for injecting network faults between clients and their server.
///
/// - [`drop_all`](Self::drop_all) resets every live connection (RST) at
///   whatever point its requests are; new connections work at once.
/// - [`black_hole`](Self::black_hole) keeps every socket open but forwards
///   nothing in either direction, including on connections opened later
///   (they are accepted and then stall): a partition, as the client sees
///   it. Bytes sent meanwhile stay queued, as TCP would retransmit them.
/// - [`heal`](Self::heal) resumes forwarding; queued bytes are delivered late
///   (a healed partition).
/// - [`delay`](Self::delay) holds every byte for a while in one direction
///   (requests or replies), on every connection;
///   [`delay_connection`](Self::delay_connection) on one connection only
///   (say, a client's pub/sub connection). Order is kept; bytes read while
///   a delay is set keep that delay.
/// - [`hold`](Self::hold) holds back one direction only (say, replies)
///   until [`pass`](Self::pass): requests still take effect on the server.
/// - [`down`](Self::down) resets every connection and every new one until
///   [`up`](Self::up): the server looks dead (connection reset).
///
/// Dropping the proxy closes its listener and every connection.
///
/// Needs a tokio runtime (it runs tasks per connection direction).
///
/// ```no_run
/// use std::time::Duration;
/// use distlock_conformance::fault::{Direction, Proxy};
/// # async fn demo(server: std::net::SocketAddr) -> std::io::Result<()> {
/// let proxy = Proxy::start(server).await?;
/// let url = format!("redis://{}", proxy.addr()); // the client goes through it
/// proxy.delay(Direction::ToClient, Duration::from_millis(300)); // slow replies
/// proxy.black_hole(); // the client's requests now hang
/// proxy.heal();
/// proxy.drop_all(); // its connections are reset; it reconnects
/// proxy.down(); // and now it cannot
/// proxy.up();
/// # let _ = url; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    target: SocketAddr,
    state: watch::Sender<State>,
    accepted: Arc<AtomicUsize>,
    /// Connections whose sockets are still open.
    open: Arc<AtomicUsize>,
}

impl Proxy {
    /// Starts a proxy forwarding to `target`, listening on a free loopback
    /// port.
    pub async fn start(target: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(State::default());
        let accepted = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        tokio::spawn(accept_loop(
            listener,
            target,
            state.subscribe(),
            (accepted.clone(), open.clone()),
        ));
        tracing::debug!(%addr, %target, "fault proxy started");
        Ok(Proxy {
            addr,
            target,
            state,
            accepted,
            open,
        })
    }

    /// The address clients connect to instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server it forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// How many client connections it accepted so far (the index of the
    /// next one, for [`delay_connection`](Self::delay_connection)).
    pub fn connections_accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// How many connections through it still have their sockets open (a
    /// cut takes effect on each connection's own task, a moment later).
    pub fn connections_open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Resets every live connection (both sides see a reset or end of
    /// stream). Does not change black-holing; new connections are accepted.
    pub fn drop_all(&self) {
        self.state.send_modify(|s| s.epoch += 1);
        tracing::debug!(addr = %self.addr, "fault proxy: all connections dropped");
    }

    /// Stops forwarding in both directions on every connection, present and
    /// future, while keeping the sockets open.
    pub fn black_hole(&self) {
        self.state.send_modify(|s| s.black_hole = true);
        tracing::debug!(addr = %self.addr, "fault proxy: black hole");
    }

    /// Resumes forwarding after [`black_hole`](Self::black_hole).
    pub fn heal(&self) {
        self.state.send_modify(|s| s.black_hole = false);
        tracing::debug!(addr = %self.addr, "fault proxy: healed");
    }

    /// Whether it is black-holing right now.
    pub fn is_black_hole(&self) -> bool {
        self.state.borrow().black_hole
    }

    /// Holds back every byte travelling in `direction`, on every
    /// connection, live or future, until [`pass`](Self::pass); the other
    /// direction flows. With [`Direction::ToClient`]: requests reach the
    /// server and take effect, in order, while the client hears nothing
    /// (its answers lost for a while, as in a one-way partition).
    pub fn hold(&self, direction: Direction) {
        self.state.send_modify(|s| s.held[direction.index()] = true);
        tracing::debug!(addr = %self.addr, ?direction, "fault proxy: hold");
    }

    /// Delivers what [`hold`](Self::hold) held back in `direction`, late,
    /// and forwards again.
    pub fn pass(&self, direction: Direction) {
        self.state
            .send_modify(|s| s.held[direction.index()] = false);
        tracing::debug!(addr = %self.addr, ?direction, "fault proxy: pass");
    }

    /// Holds every byte travelling in `direction` for `delay` before
    /// passing it on, on every connection without a per-connection delay
    /// (zero: no delay). Takes effect for bytes read from now on.
    pub fn delay(&self, direction: Direction, delay: Duration) {
        self.state
            .send_modify(|s| s.delay[direction.index()] = delay);
        tracing::debug!(addr = %self.addr, ?direction, ?delay, "fault proxy: delay");
    }

    /// As [`delay`](Self::delay), for the `connection`-th connection it
    /// accepted (from 0, in accept order) only, live or future.
    pub fn delay_connection(&self, connection: usize, direction: Direction, delay: Duration) {
        self.state.send_modify(|s| {
            s.connection_delay.insert((connection, direction), delay);
        });
        tracing::debug!(addr = %self.addr, connection, ?direction, ?delay, "fault proxy: connection delay");
    }

    /// The server "dies": every live connection is reset, and every new one
    /// is reset as soon as it is accepted, until [`up`](Self::up).
    pub fn down(&self) {
        self.state.send_modify(|s| {
            s.down = true;
            s.epoch += 1;
        });
        tracing::debug!(addr = %self.addr, "fault proxy: down");
    }

    /// New connections are forwarded again after [`down`](Self::down).
    pub fn up(&self) {
        self.state.send_modify(|s| s.down = false);
        tracing::debug!(addr = %self.addr, "fault proxy: up");
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.send_modify(|s| s.closed = true);
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    mut state: watch::Receiver<State>,
    (accepted, open): (Arc<AtomicUsize>, Arc<AtomicUsize>),
) {
    loop {
        let client = tokio::select! {
            client = listener.accept() => client,
            changed = state.changed() => {
                if changed.is_err() || state.borrow().closed {
                    return;
                }
                continue;
            }
        };
        match client {
            Ok((client, _)) => {
                let index = accepted.fetch_add(1, Ordering::SeqCst);
                let (epoch, down) = {
                    let state = state.borrow();
                    (state.epoch, state.down)
                };
                if down {
                    reset(&client);
                    continue;
                }
                let (open, state) = (Open::count(&open), state.clone());
                tokio::spawn(async move {
                    connection(client, target, state, epoch, index).await;
                    drop(open);
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "fault proxy: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn connection(
    client: TcpStream,
    target: SocketAddr,
    mut state: watch::Receiver<State>,
    epoch: u64,
    index: usize,
) {
    let _ = client.set_nodelay(true);
    // A connection accepted during a black hole stalls before it reaches
    // the server, like a SYN lost in a partition (but the client's connect
    // has returned, as it would have with the SYN-ACK from a middlebox).
    if !until_forwarding(&mut state, epoch).await {
        reset(&client);
        return;
    }
    let server = tokio::select! {
        server = TcpStream::connect(target) => server,
        _ = wait_cut(state.clone(), epoch) => {
            reset(&client);
            return;
        }
    };
    let server = match server {
        Ok(server) => server,
        Err(e) => {
            tracing::debug!(error = %e, %target, "fault proxy: server unreachable");
            reset(&client);
            return;
        }
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let link = |direction| Leg {
        state: state.clone(),
        epoch,
        index,
        direction,
    };
    let upstream = tokio::spawn(pump(client_read, server_write, link(Direction::ToServer)));
    let downstream = tokio::spawn(pump(server_read, client_write, link(Direction::ToClient)));
    // Whichever direction ends first (end of stream, error or cut) ends
    // the connection; a cut resets both sockets.
    // The other one is awaited once aborted, so that its sockets are
    // closed when this returns.
    let (mut up, mut down) = (upstream, downstream);
    tokio::select! {
        _ = &mut up => {
            down.abort();
            let _ = down.await;
        }
        _ = &mut down => {
            up.abort();
            let _ = up.await;
        }
    }
}

/// One open connection, counted while it lives.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn count(open: &Arc<AtomicUsize>) -> Self {
        open.fetch_add(1, Ordering::SeqCst);
        Open(open.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn reset(stream: &TcpStream) {
    // SO_LINGER 0: closing sends RST instead of FIN.
    let _ = stream.set_zero_linger();
}

/// One direction of one connection.
struct Leg {
    state: watch::Receiver<State>,
    epoch: u64,
    index: usize,
    direction: Direction,
}

/// Copies `from` to `to` while the state allows, each chunk held for the
/// leg's delay; on a cut, resets both.
///
/// A reader queues what it reads with the instant it is due, and a writer
/// delivers each chunk at that instant, so a delay is a latency (chunks
/// read together arrive together), not a cumulative slowdown.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, leg: Leg) {
    let Leg {
        mut state,
        epoch,
        index,
        direction,
    } = leg;
    // `None` is the end of the stream, passed on in order.
    let (queue, mut due) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let reader = {
        let mut state = state.clone();
        async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = tokio::select! {
                    n = from.read(&mut buf) => n,
                    _ = wait_cut(state.clone(), epoch) => return from,
                    _ = &mut stopped => return from,
                };
                let delay = state.borrow_and_update().delay(index, direction);
                let chunk = match n {
                    Ok(0) => None,
                    Ok(n) => Some(buf[..n].to_vec()),
                    Err(_) => return from,
                };
                let end = chunk.is_none();
                if queue.send((Instant::now() + delay, chunk)).is_err() || end {
                    return from;
                }
            }
        }
    };
    let writer = async {
        while let Some((at, chunk)) = due.recv().await {
            let cut = tokio::select! {
                _ = tokio::time::sleep_until(at) => false,
                _ = wait_cut(state.clone(), epoch) => true,
            };
            // A black hole, or a hold of this direction, that started
            // meanwhile holds these bytes back.
            if cut || !until_passing(&mut state, epoch, direction).await {
                return false;
            }
            let Some(chunk) = chunk else {
                // End of stream: pass it on.
                let _ = to.shutdown().await;
                return true;
            };
            let written = tokio::select! {
                r = to.write_all(&chunk) => r,
                _ = wait_cut(state.clone(), epoch) => return false,
            };
            if written.is_err() {
                return false;
            }
        }
        false
    };
    let reader = tokio::spawn(reader);
    let clean_end = writer.await;
    drop(stop);
    if let Ok(from) = reader.await {
        if !clean_end {
            reset(from.as_ref());
        }
    }
    if !clean_end {
        reset(to.as_ref());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An echo server on a loopback port.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(stream: &mut TcpStream, text: &[u8]) -> io::Result<Vec<u8>> {
        stream.write_all(text).await?;
        let mut buf = vec![0; text.len()];
        stream.read_exact(&mut buf).await?;
        Ok(buf)
    }

    #[tokio::test]
    async fn forwards_drops_black_holes_and_heals() {
        let proxy = Proxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut stream, b"ping").await.unwrap(), b"ping");

        // Black hole: nothing comes back, even on a new connection.
        proxy.black_hole();
        let stalled =
            tokio::time::timeout(Duration::from_millis(200), round_trip(&mut stream, b"lost"))
                .await;
        assert!(stalled.is_err(), "a black hole forwarded bytes");
        let mut late = TcpStream::connect(proxy.addr()).await.unwrap();
        late.write_all(b"late").await.unwrap();

        // Heal: the queued bytes arrive, late.
        proxy.heal();
        let mut buf = [0; 4];
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"lost");
        late.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"late");

        // Drop: live connections end; new ones work.
        proxy.drop_all();
        let mut buf = [0; 1];
        let cut = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("a dropped connection must end");
        assert!(matches!(cut, Ok(0) | Err(_)), "read after drop: {cut:?}");
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut fresh, b"again").await.unwrap(), b"again");
        assert_eq!(proxy.connections_accepted(), 3);
    }

    #[tokio::test]
    async fn holds_one_direction_until_passed() {
        // An echo server that also reports what it received.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = listener.local_addr().unwrap();
        let (received, mut heard) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0; 64];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                let _ = received.send(buf[..n].to_vec());
            }
        });
        let proxy = Proxy::start(server).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut stream, b"warm").await.unwrap(), b"warm");
        assert_eq!(heard.recv().await.unwrap(), b"warm");

        // Replies held: the request still reaches the server.
        proxy.hold(Direction::ToClient);
        stream.write_all(b"held").await.unwrap();
        assert_eq!(heard.recv().await.unwrap(), b"held");
        let mut buf = [0; 4];
        let early =
            tokio::time::timeout(Duration::from_millis(200), stream.read_exact(&mut buf)).await;
        assert!(early.is_err(), "a held reply arrived");

        // Passed: the held reply arrives, and later ones flow.
        proxy.pass(Direction::ToClient);
        stream.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"held");
        assert_eq!(round_trip(&mut stream, b"flow").await.unwrap(), b"flow");
    }

    #[tokio::test]
    async fn delays_one_direction_per_connection_and_plays_dead() {
        let proxy = Proxy::start(echo().await).await.unwrap();
        let mut slow = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut fast = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut slow, b"warm").await.unwrap(), b"warm");
        assert_eq!(round_trip(&mut fast, b"warm").await.unwrap(), b"warm");

        // Replies of the first connection only are held back, in order.
        proxy.delay_connection(0, Direction::ToClient, Duration::from_secs(3600));
        slow.write_all(b"one").await.unwrap();
        slow.write_all(b"two").await.unwrap();
        assert_eq!(round_trip(&mut fast, b"fast").await.unwrap(), b"fast");
        let mut buf = [0; 6];
        let held =
            tokio::time::timeout(Duration::from_millis(200), slow.read_exact(&mut buf)).await;
        assert!(held.is_err(), "a delayed reply arrived early");

        // A delay for every connection: replies still arrive, in order.
        proxy.delay(Direction::ToServer, Duration::from_millis(20));
        assert_eq!(round_trip(&mut fast, b"later").await.unwrap(), b"later");

        // Down: live connections end, new ones are reset; up: back.
        proxy.down();
        let mut one = [0; 1];
        let cut = tokio::time::timeout(Duration::from_secs(5), fast.read(&mut one))
            .await
            .expect("a connection must end when the proxy goes down");
        assert!(matches!(cut, Ok(0) | Err(_)), "read after down: {cut:?}");
        let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), round_trip(&mut refused, b"x"))
            .await
            .expect("a connection to a down proxy must end");
        assert!(answer.is_err(), "a down proxy forwarded: {answer:?}");
        proxy.up();
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut again, b"up").await.unwrap(), b"up");
    }
}
