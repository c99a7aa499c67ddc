//! The operator commands: `status` and `inspect` read a key, `release
//! --force` frees it whoever holds it.

use std::time::Duration;

use distlock::{
    AcquireAttempt, ErrorKind, FencingToken, HolderId, LockClient, LockKey, LockState, PermitState,
};

use crate::app::{code, connect, lock_key, Failure};
use crate::args::{ReleaseArgs, UrlArg};
use crate::duration::format_duration;

/// Probes `key` with the shortest TTL the backend allows; a lease it gets is
/// released at once.
async fn probe(backend: &LockClient, key: &LockKey) -> Result<AcquireAttempt, Failure> {
    let ttl = backend.capabilities().min_ttl.max(Duration::from_millis(1));
    let attempt = backend
        .try_acquire(key, ttl)
        .await
        .map_err(|e| Failure::lock("cannot check the lock", &e))?;
    if let AcquireAttempt::Acquired(lease) = &attempt {
        // Ignore NotHeld: the probe's short lease may already have run out.
        match backend.release(lease).await {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotHeld => {}
            Err(e) => return Err(Failure::lock("cannot release the probe lease", &e)),
        }
    }
    Ok(attempt)
}

/// What `status` found at a key.
struct Seen {
    held: bool,
    /// The holder's, when the backend says (not through a probe).
    fencing_token: Option<FencingToken>,
    /// The holder's label, when the backend stores one and it gave one.
    holder: Option<HolderId>,
    /// Time left on the holder's lease by the server's clock, if known.
    expires_in: Option<Duration>,
}

/// Reads `key`: the backend's inspect call, or, on a backend without
/// operator calls, a probe.
async fn look(backend: &LockClient, key: &LockKey) -> Result<Seen, Failure> {
    if backend.admin().is_none() {
        // An attempt tells held or free (and uses up one fencing token
        // value if free).
        return Ok(match probe(backend, key).await? {
            AcquireAttempt::Acquired(_) => Seen {
                held: false,
                fencing_token: None,
                holder: None,
                expires_in: None,
            },
            AcquireAttempt::Held { expires_in } => Seen {
                held: true,
                fencing_token: None,
                holder: None,
                expires_in,
            },
        });
    }
    let state = backend
        .inspect(key)
        .await
        .map_err(|e| Failure::lock("cannot inspect the lock", &e))?;
    Ok(match state {
        LockState::Held {
            expires_in,
            fencing_token,
            holder,
        } => Seen {
            held: true,
            fencing_token: Some(fencing_token),
            holder,
            expires_in,
        },
        _ => Seen {
            held: false,
            fencing_token: None,
            holder: None,
            expires_in: None,
        },
    })
}

/// `(fencing token 7, holder "web-1:4242", lease expires in 4.2s unless
/// its holder renews it)`: what is known of a holder. The label is quoted
/// (it may hold spaces or commas).
pub(crate) fn describe_holder(
    fencing_token: Option<FencingToken>,
    holder: Option<&HolderId>,
    expires_in: Option<Duration>,
) -> String {
    let mut parts = Vec::new();
    if let Some(token) = fencing_token {
        parts.push(format!("fencing token {token}"));
    }
    if let Some(holder) = holder {
        parts.push(format!("holder {holder:?}"));
    }
    match expires_in {
        Some(left) => parts.push(format!(
            "lease expires in {} unless its holder renews it",
            format_duration(left)
        )),
        None => parts.push("the server did not say for how long".to_owned()),
    }
    format!("({})", parts.join(", "))
}

/// Milliseconds for JSON (saturating; a lease is never that long).
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// What `status` prints for `seen` at `key`: one JSON object (`json`) or
/// one sentence.
fn render(key: &LockKey, seen: &Seen, backend: &str, json: bool) -> String {
    if json {
        // The field names are documented (status --help, README) and stable.
        let object = serde_json::json!({
            "key": key.as_str(),
            "held": seen.held,
            "fencing_token": seen.fencing_token.map(|token| token.get()),
            "expires_in_ms": seen.expires_in.map(millis),
            "holder": seen.holder.as_ref().map(HolderId::as_str),
            "backend": backend,
        });
        object.to_string()
    } else if seen.held {
        format!(
            "{key}: held {}",
            describe_holder(seen.fencing_token, seen.holder.as_ref(), seen.expires_in)
        )
    } else {
        format!("{key}: free")
    }
}

pub(crate) async fn status(
    url: UrlArg,
    key: &str,
    json: bool,
    semaphore: bool,
) -> Result<u8, Failure> {
    let key = lock_key(key)?;
    let backend = connect(&url.url).await?;
    if semaphore {
        let permits = backend
            .inspect_permits(&key)
            .await
            .map_err(|e| Failure::lock("cannot list the semaphore's permits", &e))?;
        println!("{}", render_permits(&key, &permits, backend.name(), json));
        let full = permits
            .first()
            .is_some_and(|p| permits.len() >= p.limit as usize);
        return Ok(if full { code::TEMPFAIL } else { code::OK });
    }
    let seen = look(&backend, &key).await?;
    println!("{}", render(&key, &seen, backend.name(), json));
    Ok(if seen.held { code::TEMPFAIL } else { code::OK })
}

/// What `status --semaphore` prints for the live `permits` of `key`: one
/// JSON object (`json`), or a sentence and a line per permit.
fn render_permits(key: &LockKey, permits: &[PermitState], backend: &str, json: bool) -> String {
    let limit = permits.first().map(|p| p.limit);
    if json {
        // The field names are documented (status --help) and stable.
        let listed: Vec<_> = permits
            .iter()
            .map(|p| {
                serde_json::json!({
                    "fencing_token": p.fencing_token.get(),
                    "expires_in_ms": p.expires_in.map(millis),
                    "holder": p.holder.as_ref().map(HolderId::as_str),
                })
            })
            .collect();
        let object = serde_json::json!({
            "key": key.as_str(),
            "semaphore": true,
            "limit": limit,
            "held": permits.len(),
            "permits": listed,
            "backend": backend,
        });
        return object.to_string();
    }
    let Some(limit) = limit else {
        return format!("{key}: semaphore, no permit held");
    };
    let mut lines = vec![format!(
        "{key}: semaphore, {} of {limit} permits held",
        permits.len()
    )];
    lines.extend(permits.iter().map(|p| {
        format!(
            "  permit {}",
            describe_holder(Some(p.fencing_token), p.holder.as_ref(), p.expires_in)
        )
    }));
    lines.join("\n")
}

pub(crate) async fn release(args: ReleaseArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    if !args.force {
        return Err(Failure::new(
            code::USAGE,
            format!(
                "refusing to release lock {key:?} without --force: a running holder would lose it mid-job"
            ),
        ));
    }
    let backend = connect(&args.url.url).await?;
    let was_held = backend
        .force_release(&key)
        .await
        .map_err(|e| Failure::lock("cannot force-release the lock", &e))?;
    if was_held {
        println!("{key}: released; its holder loses the lock at its next renewal");
    } else {
        println!("{key}: free; nothing to release");
    }
    Ok(code::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlock::{LockOptions, Locker, MemoryLock};

    /// The label a holder gave shows in both outputs (memory stores
    /// labels; a server backend may not yet).
    #[tokio::test]
    async fn status_shows_the_holder_label() {
        let server = MemoryLock::new();
        let client = server.client();
        let key = LockKey::new("labelled").unwrap();
        let free = look(&client, &key).await.unwrap();
        assert_eq!(render(&key, &free, "memory", false), "labelled: free");
        let options = LockOptions::new(Duration::from_secs(30))
            .with_holder(HolderId::new("web 1, pid 42").unwrap());
        let guard = Locker::new(client.clone())
            .try_lock(&key, &options)
            .await
            .unwrap()
            .expect("free");
        let seen = look(&client, &key).await.unwrap();
        let line = render(&key, &seen, "memory", false);
        assert!(
            line.starts_with(&format!(
                "labelled: held (fencing token {}, holder \"web 1, pid 42\", lease expires in ",
                guard.fencing_token()
            )),
            "{line}"
        );
        let object: serde_json::Value =
            serde_json::from_str(&render(&key, &seen, "memory", true)).unwrap();
        assert_eq!(object["holder"], "web 1, pid 42");
        assert_eq!(object["held"], true);
        guard.release().await.unwrap();
        let free = look(&client, &key).await.unwrap();
        let object: serde_json::Value =
            serde_json::from_str(&render(&key, &free, "memory", true)).unwrap();
        assert!(object["holder"].is_null(), "{object}");
    }

    /// `status --semaphore` lists each live permit with its token and
    /// label (none for a permit taken without one), in both outputs.
    #[tokio::test]
    async fn status_shows_the_permit_labels() {
        let server = MemoryLock::new();
        let client = server.client();
        let key = LockKey::new("exports").unwrap();
        let listed = || client.inspect_permits(&key);
        let none = listed().await.unwrap();
        assert_eq!(
            render_permits(&key, &none, "memory", false),
            "exports: semaphore, no permit held"
        );
        let options = LockOptions::new(Duration::from_secs(30)).with_permits(3);
        let locker = Locker::new(client.clone());
        let labelled = options
            .clone()
            .with_holder(HolderId::new("web 1, pid 42").unwrap());
        let first = locker
            .try_lock(&key, &labelled)
            .await
            .unwrap()
            .expect("free");
        let second = locker
            .try_lock(&key, &options)
            .await
            .unwrap()
            .expect("free");
        let permits = listed().await.unwrap();
        let text = render_permits(&key, &permits, "memory", false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0], "exports: semaphore, 2 of 3 permits held",
            "{text}"
        );
        assert!(
            lines[1].starts_with(&format!(
                "  permit (fencing token {}, holder \"web 1, pid 42\", lease expires in ",
                first.fencing_token()
            )),
            "{text}"
        );
        assert!(
            lines[2].starts_with(&format!(
                "  permit (fencing token {}, lease expires in ",
                second.fencing_token()
            )),
            "{text}"
        );
        let object: serde_json::Value =
            serde_json::from_str(&render_permits(&key, &permits, "memory", true)).unwrap();
        assert_eq!(object["semaphore"], true);
        assert_eq!(object["limit"], 3);
        assert_eq!(object["held"], 2);
        assert_eq!(object["permits"][0]["holder"], "web 1, pid 42");
        assert_eq!(
            object["permits"][0]["fencing_token"],
            first.fencing_token().get()
        );
        assert!(object["permits"][1]["holder"].is_null(), "{object}");
        first.release().await.unwrap();
        second.release().await.unwrap();
        let object: serde_json::Value =
            serde_json::from_str(&render_permits(&key, &[], "memory", true)).unwrap();
        assert!(object["limit"].is_null(), "{object}");
        assert_eq!(object["permits"], serde_json::json!([]));
    }
}
