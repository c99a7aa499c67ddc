//! Sending a statement under the client's timeouts, and again when that
//! rides out a lost connection or a transaction pooler met mid-way (what a
//! failure says is [`crate::errors`]' business; how one send runs and is
//! cancelled safely, [`crate::sql::run`]).

use std::sync::Arc;

use distlock_core::{request_message, LockError, IN_LOCK_CALL};
use sqlx::postgres::PgRow;
use tokio::time::Instant;

use crate::backend::PostgresLock;
use crate::errors;
use crate::sql::{self, Arg, Call, GiveBack, Protocol, Reply};

impl PostgresLock {
    /// A statement on `sql` with `args`, for this client's protocol.
    pub(crate) fn call(&self, sql: &Arc<sql::Sql>, args: Vec<Arg>) -> Call {
        Call::new(self.protocol(), sql, args)
    }

    /// The error of a statement (`what`) whose operation timeout ran out.
    fn timed_out(&self, what: &str) -> LockError {
        LockError::timeout(request_message(
            what,
            format_args!(
                "no reply within the operation timeout of {:?} (counted from its first send, resends included); \
                 whether it took effect is unknown; the server may be down or overloaded",
                self.config().client().operation_timeout()
            ),
        ))
    }

    /// Runs one statement (see [`sql::send`]) and returns its reply: a
    /// pooled connection within the connect timeout (the pool's acquire
    /// timeout), then the statement within the operation timeout, counted
    /// from its first send, whatever is resent.
    ///
    /// A connection found broken — closed by the server while idle in the
    /// pool (`idle_session_timeout`, a restart, a pooler's own timeouts) or
    /// terminated while the statement ran (`pg_terminate_backend`) — is
    /// closed and the statement sent again on another one, while the
    /// deadline of the first send allows and at most once per pooled
    /// connection and one more: every lock statement reads correctly when
    /// repeated (see [`sql::send`]), so the caller sees an error only if
    /// the server stays unreachable.
    ///
    /// Cancel-safe: the statement runs on a task of its own, which reads
    /// its reply even after this future was dropped or timed out, then
    /// gives the connection back (or closes it), and gives back a lock an
    /// acquire was granted with `give_back`; it reads no longer than one
    /// more operation timeout.
    pub(crate) async fn fetch(
        &self,
        what: &str,
        call: Call,
        mut give_back: Option<GiveBack>,
    ) -> Result<Reply, LockError> {
        let mut call = Arc::new(call);
        let timeout = self.config().client().operation_timeout();
        // Set at the first send: resends share it.
        let mut deadline: Option<Instant> = None;
        let mut lost = 0;
        let mut resent = false;
        loop {
            let conn = match deadline {
                None => self.pool().acquire().await,
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline, self.pool().acquire()).await {
                        Ok(conn) => conn,
                        Err(_) => return Err(self.timed_out(what)),
                    }
                }
            }
            .map_err(|e| errors::map(e, what))?;
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            let mut sent = sql::send(
                conn,
                call.clone(),
                give_back.clone(),
                deadline + timeout,
                timeout,
            );
            let Some(mut done) = sent.wait(deadline).await else {
                return Err(self.timed_out(what));
            };
            match done.take() {
                Some(Ok(mut reply)) => {
                    reply.resent |= resent;
                    return Ok(reply);
                }
                // Another client's prepared statements (or none where
                // sqlx prepared one): a transaction pooler. The statement
                // did not run (refused at Parse or Bind): send it again,
                // as every later one, with the simple protocol.
                Some(Err(e))
                    if call.is_prepared()
                        && errors::is_shared_prepared_statement(&e)
                        && Instant::now() < deadline =>
                {
                    if !self.use_simple_protocol() {
                        tracing::warn!(
                            error = %e,
                            "a statement met another client's prepared statements: the PostgreSQL URL reaches a transaction pooler; \
                             using the simple query protocol from now on (add pool_mode=transaction to the URL, and listen_url=<a URL past the pooler> so that waiters are woken by NOTIFY)"
                        );
                    }
                    call = Arc::new(call.simple());
                    if let Some(give_back) = &mut give_back {
                        give_back.protocol = Protocol::Simple;
                    }
                }
                Some(Err(e))
                    if errors::is_connection_lost(&e)
                        && lost <= self.pool().options().get_max_connections()
                        && Instant::now() < deadline =>
                {
                    lost += 1;
                    // The statement may have run before the connection
                    // broke: the next reply is read as a repeat.
                    resent = true;
                    tracing::debug!(error = %e, what, "connection lost; sending the statement again on another one");
                }
                Some(Err(e)) => return Err(errors::map(e, what)),
                None => return Err(self.timed_out(what)),
            }
        }
    }

    /// As [`fetch`](Self::fetch), for statements inside a lock call that
    /// always return a row and need no undo.
    pub(crate) async fn fetch_one(&self, call: Call) -> Result<Reply<PgRow>, LockError> {
        let reply = self.fetch(IN_LOCK_CALL, call, None).await?;
        let row = reply
            .row
            .ok_or_else(|| LockError::corrupted("the lock table returned no row"))?;
        Ok(Reply {
            row,
            resent: reply.resent,
        })
    }
}
