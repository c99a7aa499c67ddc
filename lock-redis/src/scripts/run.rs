//! Running a script: `EVALSHA`, `EVAL` when the server lost it, and the
//! `WAIT` for replica acknowledgements after a script that writes.

use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};

use super::LuaScript;

impl LuaScript {
    /// Puts the script in the server's cache (`SCRIPT LOAD`).
    pub(crate) async fn load(&self, conn: &mut impl ConnectionLike) -> RedisResult<()> {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&self.body)
            .query_async::<String>(conn)
            .await
            .map(drop)
    }

    /// Runs the script as [`invoke`](Self::invoke), then waits up to
    /// `timeout` for `replicas` to acknowledge its writes (`WAIT`, on the
    /// same connection): the script's reply and how many acknowledged.
    ///
    /// The first `WAIT` is pipelined with the script; while replicas lag,
    /// it is repeated in slices of at most [`WAIT_SLICE`]. A `WAIT` blocks
    /// its connection, which every request of this client shares: slices
    /// let other requests (a give-back of this very lock, say) through
    /// between them, and a dropped future stops waiting within one slice.
    pub(crate) async fn invoke_and_wait(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: &[String],
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<(Value, i64)> {
        // Errors stay in the replies (`ignore_errors`): a pipeline error
        // loses the error code, and so the script's own markers.
        let pipeline = |eval: bool| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            pipe.add_command(self.command(eval, keys, args));
            pipe.cmd("WAIT")
                .arg(replicas)
                .arg(wait_millis(timeout.min(WAIT_SLICE)));
            pipe
        };
        let started = std::time::Instant::now();
        let mut replies: Vec<Value> = pipeline(false).query_async(conn).await?;
        if matches!(replies.first(), Some(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::NoScript))
        {
            replies = pipeline(true).query_async(conn).await?;
        }
        let mut replies = replies.into_iter();
        let (Some(reply), Some(acknowledged), None) =
            (replies.next(), replies.next(), replies.next())
        else {
            return Err(redis::RedisError::from((
                ErrorKind::Parse,
                "a script and WAIT pipeline did not answer twice",
            )));
        };
        let reply = reply.extract_error()?;
        let mut acknowledged: i64 = redis::from_redis_value(acknowledged.extract_error()?)?;
        while acknowledged < i64::from(replicas) {
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                break;
            }
            acknowledged = redis::cmd("WAIT")
                .arg(replicas)
                .arg(wait_millis(left.min(WAIT_SLICE)))
                .query_async(conn)
                .await?;
        }
        Ok((reply, acknowledged))
    }

    /// Runs the script: `EVALSHA`, and `EVAL` with its text when the server
    /// does not have it (after a restart, a failover or `SCRIPT FLUSH`, or
    /// never loaded because the ACL user may not `SCRIPT LOAD`). `EVAL`
    /// caches the script, so the next call is one `EVALSHA` again.
    pub(crate) async fn invoke(
        &self,
        conn: &mut impl ConnectionLike,
        keys: &[&str],
        args: &[String],
    ) -> RedisResult<Value> {
        let result = self.command(false, keys, args).query_async(conn).await;
        match result {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.command(true, keys, args).query_async(conn).await
            }
            other => other,
        }
    }

    /// `EVALSHA` (or `EVAL` with the text) of `keys` and `args`, its
    /// buffers sized once (built argument by argument they grew about
    /// eight times a lock operation).
    fn command(&self, eval: bool, keys: &[&str], args: &[String]) -> Cmd {
        let (name, script) = match eval {
            true => ("EVAL", &self.body),
            false => ("EVALSHA", &self.sha),
        };
        // The key count's digits: at most 20.
        let bytes = name.len()
            + script.len()
            + 20
            + keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(String::len).sum::<usize>();
        let mut command = Cmd::with_capacity(3 + keys.len() + args.len(), bytes);
        command
            .arg(name)
            .arg(script)
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        command
    }
}

/// The longest one `WAIT` blocks the shared connection.
pub(crate) const WAIT_SLICE: Duration = Duration::from_millis(100);

/// `WAIT`'s timeout: whole milliseconds, at least 1 (0 waits forever), at
/// most a day (a bound the server adds to its clock without overflow).
fn wait_millis(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, 86_400_000)
}
