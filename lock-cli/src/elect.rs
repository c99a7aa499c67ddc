//! `elect`: campaign for leadership of a key, then run the command while
//! leading (supervised as `run` supervises it, [`crate::run::supervise`]);
//! `observe`: follow who leads a key, one line a change.

use std::io::Write as _;
use std::time::{Duration, Instant};

use distlock::{ErrorKind, Leader, LockClient, Locker};
use tokio::signal::unix::{signal, SignalKind};

use crate::app::{code, connect, holder_id, lock_key, Failure};
use crate::args::{ElectArgs, ObserveArgs};
use crate::duration::format_duration;
use crate::log::{note, warning};
use crate::run::{
    announce_wait, checked, display_command, give_back, lease_options, signal_code, supervise,
    waited, Holding, Signals,
};

pub(crate) async fn elect(args: ElectArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let identity = holder_id(&args.id)?;
    let what = display_command(&args.command.command);
    let (options, margin, kill_grace) = lease_options(&args.lease)?;
    let options = checked(options, &args.lease, margin)?;
    let mut signals = Signals::install()?;

    let started = Instant::now();
    let backend = tokio::select! {
        backend = connect(&args.url.url) => backend.map_err(|e| e.not_running(&what))?,
        signal = signals.next() => return Ok(signal_code(signal)),
    };
    tokio::select! {
        () = announce_wait(&backend, &key, "leadership of", args.wait) => {}
        signal = signals.next() => return Ok(signal_code(signal)),
    }
    let locker = Locker::new(backend);
    // --wait bounds the whole campaign, connecting included; one too far
    // off to represent is no limit.
    let deadline = args.wait.and_then(|wait| started.checked_add(wait));
    // The campaign future is dropped at the end of the select (cancel-safe:
    // nothing stays held), before the give-back below waits for the client.
    let campaigned = tokio::select! {
        result = async {
            match deadline {
                Some(at) => locker.campaign_until(&key, &identity, &options, at).await,
                None => locker.campaign(&key, &identity, &options).await.map(Some),
            }
        } => Ok(result),
        signal = signals.next() => Err(signal),
    };
    let leadership = match campaigned {
        Err(signal) => {
            give_back(&locker, &key, kill_grace, options.ttl()).await;
            return Ok(signal_code(signal));
        }
        Ok(Ok(Some(leadership))) => leadership,
        Ok(Ok(None)) => {
            let waited = waited(args.wait.unwrap_or_default());
            note!(
                key = key.as_str(),
                exit_code = args.conflict_exit_code,
                "leadership of {key:?} is held by another candidate{waited}; not running `{what}`"
            );
            return Ok(args.conflict_exit_code);
        }
        Ok(Err(e)) => return Err(Failure::lock("cannot campaign", &e).not_running(&what)),
    };
    tracing::debug!(
        target: crate::log::TARGET,
        key = key.as_str(),
        term = %leadership.term(),
        "leading {key:?} as {} (term {})",
        leadership.identity(),
        leadership.term()
    );
    supervise(
        Holding::Leadership(leadership),
        &args.command,
        &args.url.url,
        kill_grace,
        &mut signals,
    )
    .await
}

/// The first pause after a failed read; it doubles up to [`MAX_BACKOFF`]
/// and starts over after a read that works.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Whether a failure of `observe` is one retrying cannot mend (a bad URL,
/// key or backend): it ends `observe`; anything else is reported and
/// retried.
fn fatal(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::InvalidInput | ErrorKind::Config | ErrorKind::Unsupported
    )
}

/// `term=7 leader=web-1:4242`, `term=7 leader=-` (no label) or `vacant`;
/// with `json`, `{"term":7,"leader":"web-1:4242"}`, `"leader":null`, or
/// both null.
fn leader_line(leader: Option<&Leader>, json: bool) -> String {
    if json {
        let object = serde_json::json!({
            "term": leader.map(|l| l.term.get()),
            "leader": leader.and_then(|l| l.identity.as_ref()).map(|id| id.as_str()),
        });
        return object.to_string();
    }
    match leader {
        None => "vacant".to_owned(),
        Some(leader) => format!(
            "term={} leader={}",
            leader.term,
            leader.identity.as_ref().map_or("-", |id| id.as_str())
        ),
    }
}

/// SIGINT or SIGTERM: the end of `observe` (exit 0).
struct Interrupt {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Interrupt {
    fn install() -> Result<Self, Failure> {
        let install = |kind: SignalKind, name: &str| {
            signal(kind)
                .map_err(|e| Failure::new(code::SOFTWARE, format!("cannot handle {name}: {e}")))
        };
        Ok(Self {
            interrupt: install(SignalKind::interrupt(), "SIGINT")?,
            terminate: install(SignalKind::terminate(), "SIGTERM")?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// Pauses `backoff` (then doubles it) unless interrupted first: false if
/// interrupted.
async fn pause(backoff: &mut Duration, interrupt: &mut Interrupt) -> bool {
    let pause = *backoff;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    tokio::select! {
        () = tokio::time::sleep(pause) => true,
        () = interrupt.recv() => false,
    }
}

/// Connects, retrying while the server is unavailable; `None` if
/// interrupted meanwhile.
async fn connect_retrying(
    url: &str,
    interrupt: &mut Interrupt,
) -> Result<Option<LockClient>, Failure> {
    let mut backoff = FIRST_BACKOFF;
    loop {
        let failure = tokio::select! {
            connected = connect(url) => match connected {
                Ok(backend) => return Ok(Some(backend)),
                Err(failure) if failure.code != code::UNAVAILABLE => return Err(failure),
                Err(failure) => failure,
            },
            () = interrupt.recv() => return Ok(None),
        };
        warning!(
            "{}; trying again in {}",
            failure.message,
            format_duration(backoff)
        );
        if !pause(&mut backoff, interrupt).await {
            return Ok(None);
        }
    }
}

pub(crate) async fn observe(args: ObserveArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let mut interrupt = Interrupt::install()?;
    let Some(backend) = connect_retrying(&args.url.url, &mut interrupt).await? else {
        return Ok(code::OK);
    };
    if backend.admin().is_none() {
        return Err(Failure::new(
            code::CONFIG,
            format!(
                "observe reads who leads with the backend's operator calls, and the {} backend has none",
                backend.name()
            ),
        ));
    }
    let mut watch = Locker::new(backend)
        .observe(&key)
        .with_poll_interval(args.poll_interval);
    let mut backoff = FIRST_BACKOFF;
    loop {
        // `changed` is cancel-safe: a signal loses no change.
        let changed = tokio::select! {
            changed = watch.changed() => changed,
            () = interrupt.recv() => return Ok(code::OK),
        };
        match changed {
            Ok(leader) => {
                backoff = FIRST_BACKOFF;
                let line = leader_line(leader.as_ref(), args.json);
                // Stdout is line-buffered: each line goes out as it comes.
                if let Err(e) = writeln!(std::io::stdout(), "{line}") {
                    // A reader that went away (`| head -1`) ends observing.
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(code::OK);
                    }
                    return Err(Failure::new(
                        code::SOFTWARE,
                        format!("cannot write to stdout: {e}"),
                    ));
                }
            }
            Err(e) if fatal(e.kind()) => {
                return Err(Failure::lock(&format!("cannot read who leads {key:?}"), &e))
            }
            Err(e) => {
                warning!(
                    key = key.as_str(),
                    error = %e,
                    "cannot read who leads {key:?}: {e}; trying again in {}",
                    format_duration(backoff)
                );
                if !pause(&mut backoff, &mut interrupt).await {
                    return Ok(code::OK);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock::{FencingToken, HolderId};

    #[test]
    fn lines_scripts_can_parse() {
        let term = FencingToken::new(7);
        let labelled = Leader {
            identity: Some(HolderId::new("web 1:42").unwrap()),
            term,
        };
        let bare = Leader {
            identity: None,
            term,
        };
        assert_eq!(
            leader_line(Some(&labelled), false),
            "term=7 leader=web 1:42"
        );
        assert_eq!(leader_line(Some(&bare), false), "term=7 leader=-");
        assert_eq!(leader_line(None, false), "vacant");
        assert_eq!(
            leader_line(Some(&labelled), true),
            r#"{"leader":"web 1:42","term":7}"#
        );
        assert_eq!(leader_line(None, true), r#"{"leader":null,"term":null}"#);
    }
}
