//! The entry point: parses the arguments, runs one command, and turns its
//! failure into one line on stderr and a sysexits(3) code. The commands
//! are `run` ([`crate::run`]), `elect` and `observe` ([`crate::elect`]) and
//! the operator commands `status`, `inspect` and `release`
//! ([`crate::admin`]); the arguments, [`crate::args`].

use std::ffi::OsStr;
use std::process::ExitCode;

use distlock::{ErrorKind, HolderId, LockClient, LockError, LockKey};

use crate::args::{parse, Command, IdArg};
use crate::log::failure;
use crate::watchdog::{self, WATCHDOG_ARG};
use crate::{admin, elect, help, run};

/// sysexits(3) codes.
pub(crate) mod code {
    pub const OK: u8 = 0;
    pub const USAGE: u8 = 64;
    pub const UNAVAILABLE: u8 = 69;
    pub const SOFTWARE: u8 = 70;
    pub const TEMPFAIL: u8 = 75;
    pub const CONFIG: u8 = 78;
    pub const CANNOT_EXECUTE: u8 = 126;
    pub const NOT_FOUND: u8 = 127;
}

/// A failure that ends distlock: one line on stderr and an exit code.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn lock(context: &str, error: &LockError) -> Self {
        let code = match error.kind() {
            ErrorKind::InvalidInput => code::USAGE,
            ErrorKind::Unavailable | ErrorKind::Timeout => code::UNAVAILABLE,
            // Retrying cannot help; an operator must change the URL (an
            // operation this backend lacks) or the data at the key (foreign
            // data in distlock's namespace). 70 stays "lock lost".
            ErrorKind::Config | ErrorKind::Unsupported | ErrorKind::Corrupted => code::CONFIG,
            _ => code::SOFTWARE,
        };
        Self::new(code, format!("{context}: {error}"))
    }

    /// The same failure, saying that `run` did not start CMD (for failures
    /// before it starts).
    pub(crate) fn not_running(mut self, what: &str) -> Self {
        self.message.push_str(&format!("; not running `{what}`"));
        self
    }
}

pub fn main() -> ExitCode {
    if std::env::args_os().nth(1).as_deref() == Some(OsStr::new(WATCHDOG_ARG)) {
        return watchdog::run();
    }
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                code::USAGE
            } else {
                code::OK
            });
        }
    };
    crate::log::install(&cli.log);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            failure!("cannot start the async runtime: {e}");
            return ExitCode::from(code::SOFTWARE);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Status(args) => {
                admin::status(args.url, &args.key, args.json, args.semaphore).await
            }
            Command::Inspect(args) => {
                admin::status(args.url, &args.key, true, args.semaphore).await
            }
            Command::Release(args) => admin::release(args).await,
            Command::Elect(args) => elect::elect(args).await,
            Command::Observe(args) => elect::observe(args).await,
        }
    });
    // Do not wait for background tasks (a renewal in flight) on the way out.
    runtime.shutdown_background();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            failure!(exit_code = e.code, "{}", e.message);
            ExitCode::from(e.code)
        }
    }
}

pub(crate) async fn connect(url: &str) -> Result<LockClient, Failure> {
    if let Some(message) = help::not_in_this_build(url) {
        return Err(Failure::new(code::CONFIG, message));
    }
    distlock::connect(url).await.map_err(|e| {
        let mut failure = Failure::lock("cannot connect to the lock server", &e);
        if e.kind() == ErrorKind::Config {
            if let Some(hint) = help::tls_hint(&failure.message) {
                failure.message.push_str(hint);
            }
        }
        failure
    })
}

pub(crate) fn lock_key(key: &str) -> Result<LockKey, Failure> {
    LockKey::new(key).map_err(|e| Failure::new(code::USAGE, format!("bad --key {key:?}: {e}")))
}

/// The holder label of `--id`, or this process's (`<host>:<pid>`).
pub(crate) fn holder_id(arg: &IdArg) -> Result<HolderId, Failure> {
    match &arg.id {
        None => Ok(HolderId::this_process()),
        Some(name) => HolderId::new(name)
            .map_err(|e| Failure::new(code::USAGE, format!("bad --id {name:?}: {e}"))),
    }
}
