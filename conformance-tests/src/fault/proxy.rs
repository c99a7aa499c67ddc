//! A loopback TCP proxy that can cut the connections through it.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    /// Bumped by [`Proxy::drop_all`]: connections from an older epoch reset.
    epoch: u64,
    /// Forward nothing (bytes stay queued until [`Proxy::heal`]).
    black_hole: bool,
    /// The proxy was dropped: everything closes.
    closed: bool,
}

/// A TCP proxy on `127.0.0.1:<free port>` in front of one server address,
/// for injecting network faults between one client and its server.
///
/// - [`drop_all`](Self::drop_all) resets every live connection (RST) at
///   whatever point its requests are; new connections work at once.
/// - [`black_hole`](Self::black_hole) keeps every socket open but forwards
///   nothing in either direction, including on connections opened later
///   (they are accepted and then stall): a partition, as the client sees
///   it. Bytes sent meanwhile stay queued, as TCP would retransmit them.
/// - [`heal`](Self::heal) resumes forwarding; queued bytes are delivered late
///   (a healed partition).
///
/// Dropping the proxy closes its listener and every connection.
///
/// Needs a tokio runtime (it runs one task per connection direction).
///
/// ```no_run
/// use conformance_tests::fault::Proxy;
/// # async fn demo(server: std::net::SocketAddr) -> std::io::Result<()> {
/// let proxy = Proxy::start(server).await?;
/// let url = format!("redis://{}", proxy.addr()); // the client goes through it
/// proxy.black_hole(); // the client's requests now hang
/// proxy.heal();
/// proxy.drop_all(); // its connections are reset; it reconnects
/// # let _ = url; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    target: SocketAddr,
    state: watch::Sender<State>,
    accepted: Arc<AtomicUsize>,
}

impl Proxy {
    /// Starts a proxy forwarding to `target`, listening on a free loopback
    /// port.
    pub async fn start(target: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(State {
            epoch: 0,
            black_hole: false,
            closed: false,
        });
        let accepted = Arc::new(AtomicUsize::new(0));
        tokio::spawn(accept_loop(
            listener,
            target,
            state.subscribe(),
            accepted.clone(),
        ));
        tracing::debug!(%addr, %target, "fault proxy started");
        Ok(Proxy {
            addr,
            target,
            state,
            accepted,
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

    /// How many client connections it accepted so far.
    pub fn connections_accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
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
    accepted: Arc<AtomicUsize>,
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
                accepted.fetch_add(1, Ordering::SeqCst);
                let epoch = state.borrow().epoch;
                tokio::spawn(connection(client, target, state.clone(), epoch));
            }
            Err(e) => {
                tracing::debug!(error = %e, "fault proxy: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
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
async fn until_forwarding(state: &mut watch::Receiver<State>, epoch: u64) -> bool {
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

async fn connection(
    client: TcpStream,
    target: SocketAddr,
    mut state: watch::Receiver<State>,
    epoch: u64,
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
    let upstream = tokio::spawn(pump(client_read, server_write, state.clone(), epoch));
    let downstream = tokio::spawn(pump(server_read, client_write, state, epoch));
    // Whichever direction ends first (end of stream, error or cut) ends
    // the connection; a cut resets both sockets.
    let (mut up, mut down) = (upstream, downstream);
    tokio::select! {
        _ = &mut up => down.abort(),
        _ = &mut down => up.abort(),
    }
}

/// Resolves when a connection of `epoch` must be cut.
async fn wait_cut(mut state: watch::Receiver<State>, epoch: u64) {
    loop {
        if matches!(verdict(&state.borrow_and_update(), epoch), Verdict::Cut) {
            return;
        }
        if state.changed().await.is_err() {
            return;
        }
    }
}

fn reset(stream: &TcpStream) {
    // SO_LINGER 0: closing sends RST instead of FIN.
    let _ = stream.set_zero_linger();
}

/// Copies `from` to `to` while the state allows; on a cut, resets both.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    epoch: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !until_forwarding(&mut state, epoch).await {
            break;
        }
        let n = tokio::select! {
            n = from.read(&mut buf) => n,
            _ = state.changed() => continue,
        };
        let n = match n {
            Ok(0) => {
                // End of stream: pass it on.
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
            Err(_) => break,
        };
        // A black hole that started while reading holds these bytes back.
        if !until_forwarding(&mut state, epoch).await {
            break;
        }
        let written = tokio::select! {
            r = to.write_all(&buf[..n]) => r,
            _ = wait_cut(state.clone(), epoch) => break,
        };
        if written.is_err() {
            break;
        }
    }
    reset(from.as_ref());
    reset(to.as_ref());
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
}
