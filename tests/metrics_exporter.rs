//! examples/metrics_exporter.rs, scraped once over HTTP: every series
//! distlock describes is served with its `# HELP` and `# TYPE` lines.
//!
//! The example's own code runs here, included as a module (its `run`,
//! everything but argument parsing and the log subscriber in `main`):
//! Cargo builds no example for `--test`, gives tests no path to one, and a
//! `cargo run` from inside a test would wait on the build lock its own
//! `cargo test` holds. This test binary has the process to itself, so the
//! example's global recorder is installed once, as in the example.

use std::net::SocketAddr;

use distlock_core::instrument::names;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

// `main` and the argument parsing are not used from here.
#[allow(dead_code)]
#[path = "../examples/metrics_exporter.rs"]
mod example;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporter_serves_every_described_series() {
    let (ready, serving) = oneshot::channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let example = tokio::spawn(async move {
        let ready = move |addr| {
            let _ = ready.send(addr);
        };
        let stop = async move {
            let _ = stopped.await;
        };
        example::run("memory://metrics-test", 0, ready, stop).await
    });
    let Ok(addr) = serving.await else {
        panic!("the example stopped before serving: {:?}", example.await);
    };
    // Every line, the first included, starts after a newline.
    let page = format!("\n{}", scrape(addr).await);
    stop.send(()).unwrap();
    example.await.unwrap().unwrap();

    let series = [
        (names::ATTEMPTS, "counter"),
        (names::ACQUIRED, "counter"),
        (names::HELD_ELSEWHERE, "counter"),
        (names::ERRORS, "counter"),
        (names::LOST, "counter"),
        (names::RENEWALS, "counter"),
        // The exporter's default for histograms: quantiles.
        (names::WAIT_SECONDS, "summary"),
        (names::HOLD_SECONDS, "summary"),
        (names::OPERATION_SECONDS, "summary"),
        (names::HELD_LOCKS, "gauge"),
    ];
    for (name, kind) in series {
        assert!(
            page.contains(&format!("\n# HELP {name} ")),
            "no HELP for {name}:\n{page}"
        );
        assert!(
            page.contains(&format!("\n# TYPE {name} {kind}\n")),
            "no TYPE {kind} for {name}:\n{page}"
        );
    }
    // The leader lock the example holds while it serves.
    let held = format!("\n{}{{backend=\"memory\"}} 1\n", names::HELD_LOCKS);
    assert!(page.contains(&held), "no held lock:\n{page}");
    for outcome in ["ok", "failed"] {
        let renewals = format!(
            "\n{}{{backend=\"memory\",outcome=\"{outcome}\"}} ",
            names::RENEWALS
        );
        assert!(page.contains(&renewals), "no {outcome} renewal:\n{page}");
    }
}

/// One `GET /metrics` over a plain TCP connection; the body.
async fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}
