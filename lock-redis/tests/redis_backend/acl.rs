//! ACL users: EVAL without SCRIPT LOAD, missing permissions named at
//! connect, a release whose notification the server refused.

use std::time::Duration;

use distlock_conformance::server;
use distlock_core::ErrorKind;
use distlock_redis::redis::{self, AsyncCommands};

use crate::support::*;

/// An ACL user without `SCRIPT` (so no `SCRIPT LOAD`) used
/// to connect and then fail every acquire with Config; the scripts are now
/// sent with EVAL when the server does not have them. The user has exactly
/// the permissions the crate docs list.
#[tokio::test]
async fn an_acl_user_without_script_permission_runs_the_scripts_with_eval() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    // Exactly the permissions the crate docs list (no SCRIPT).
    acl_user(&mut admin, "noscript", DOC_PERMISSIONS).await;
    let flush = || async {
        let mut admin = raw(&server.url()).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
    };
    flush().await;
    let url = format!("redis://noscript:pw@{}", server.addr());
    let holder = connect(&url).await.unwrap();
    let waiter = connect(&url).await.unwrap();

    let key = unique_key("noscript");
    let lease = acquired(
        holder
            .try_acquire(&key, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let lease = holder.extend(&lease, Duration::from_secs(5)).await.unwrap();
    holder.release(&lease).await.unwrap();
    let permit = acquired(
        holder
            .try_acquire_permit(&key, 2, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let permit = holder
        .extend(&permit, Duration::from_secs(5))
        .await
        .unwrap();
    holder.release(&permit).await.unwrap();

    // The script cache emptied (a restart, a failover): EVAL again.
    flush().await;
    let waiting = Waiting::start(&holder, &waiter, &mut admin, "noscript-wait").await;
    let got = waiting.release_wakes_the_waiter(&holder, &mut admin).await;
    flush().await;
    assert!(matches!(
        waiter.inspect(got.key()).await.unwrap(),
        distlock_core::LockState::Held { .. }
    ));
    assert!(waiter.force_release(got.key()).await.unwrap());
}

/// An ACL user that cannot do what distlock needs is
/// refused at connect, with a message naming the missing permission, instead
/// of failing (or silently not notifying waiters) later.
#[tokio::test]
async fn acl_users_missing_permissions_are_refused_at_connect() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "noeval",
            &["~distlock:*", "&distlock:*", "+@all", "-eval", "-evalsha"],
            "EVAL",
        ),
        (
            "nochannels",
            &["~distlock:*", "resetchannels", "+@all"],
            "&distlock:*",
        ),
        ("otherkeys", &["~other:*", "&*", "+@all"], "~distlock:*"),
        (
            "readonly",
            &["%R~distlock:*", "&distlock:*", "+@all"],
            "~distlock:*",
        ),
        (
            "nopublish",
            &["~distlock:*", "&distlock:*", "+@all", "-publish"],
            "PUBLISH",
        ),
        (
            "nozadd",
            &["~distlock:*", "&distlock:*", "+@all", "-zadd"],
            "ZADD",
        ),
        (
            "lockkeysonly",
            &[
                "~distlock:*:lock",
                "~distlock:*:fence",
                "~distlock:*:gone",
                "&distlock:*",
                "+@all",
            ],
            "~distlock:*",
        ),
        // Every lock and semaphore name, but not the format marker.
        (
            "noformat",
            &["~distlock:{*", "&distlock:*", "+@all"],
            "~distlock:*",
        ),
    ];
    for (user, rules, named) in cases {
        acl_user(&mut admin, user, rules).await;
        let url = format!("redis://{user}:pw@{}", server.addr());
        let err = connect(&url)
            .await
            .expect_err(&format!("{user} ({rules:?}) is refused at connect"));
        assert_eq!(err.kind(), ErrorKind::Config, "{user}: {err}");
        assert!(
            err.message().contains(named),
            "{user}: the message does not name {named:?}: {err}"
        );
        assert!(
            !err.to_string().contains(":pw@"),
            "the password leaked: {err}"
        );
    }
    // The same user works in a namespace it may use.
    let lock = connect(&format!(
        "redis://otherkeys:pw@{}/?namespace=other",
        server.addr()
    ))
    .await
    .unwrap();
    let lease = acquired(
        lock.try_acquire(&unique_key("other"), Duration::from_secs(5))
            .await
            .unwrap(),
    );
    lock.release(&lease).await.unwrap();
}

/// The release script deletes the key before it publishes;
/// a refused PUBLISH (channel permission revoked) used to turn a release
/// that happened into an error. Releases and force-releases now report
/// success (the lost notification is logged; waiters fall back to timers).
#[tokio::test]
async fn a_release_whose_notification_is_refused_still_succeeds() {
    let server = start(server::Redis::default());
    let mut admin = raw(&server.url()).await;
    acl_user(
        &mut admin,
        "revoked",
        &["~distlock:*", "&distlock:*", "+@all"],
    )
    .await;
    let lock = connect(&format!("redis://revoked:pw@{}", server.addr()))
        .await
        .unwrap();
    let released = unique_key("revoked");
    let forced = unique_key("revoked-forced");
    let lease = acquired(
        lock.try_acquire(&released, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    acquired(
        lock.try_acquire(&forced, Duration::from_secs(30))
            .await
            .unwrap(),
    );
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("revoked")
        .arg("resetchannels")
        .query_async(&mut admin)
        .await
        .unwrap();

    lock.release(&lease).await.unwrap();
    assert!(lock.force_release(&forced).await.unwrap());
    for key in [&released, &forced] {
        let exists: bool = admin.exists(lock_key_of(key)).await.unwrap();
        assert!(!exists, "{key:?} was released");
    }
    assert_eq!(
        lock.release(&lease).await.unwrap_err().kind(),
        ErrorKind::NotHeld
    );
}
