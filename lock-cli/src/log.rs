//! What distlock says on stderr: its own lines and the library's tracing
//! events (acquire, wait, renew, lost, release), through one `tracing`
//! subscriber, as text for people or one JSON object a line for machines.
//!
//! Levels: `-q` only errors; by default distlock's own notes (a wait that
//! starts, a run that is skipped) and the library's warnings (a failed
//! renewal, a lost lock); each `-v` one level more. Without `-q`/`-v`,
//! `RUST_LOG` (an `EnvFilter` directive list) replaces the default.

use std::fmt::{self, Write as _};

use clap::{Args, ValueEnum};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// The target of distlock's own lines (the library's are its module paths:
/// `distlock_core::guard`, `distlock_redis::backend`, ...).
pub const TARGET: &str = "distlock_cli";

/// An info line of distlock's own (shown by default, not with `-q`).
macro_rules! note {
    ($($arg:tt)+) => { tracing::info!(target: $crate::log::TARGET, $($arg)+) };
}

/// A warning of distlock's own (shown by default, not with `-q`).
macro_rules! warning {
    ($($arg:tt)+) => { tracing::warn!(target: $crate::log::TARGET, $($arg)+) };
}

/// An error line of distlock's own: why it fails (shown even with `-q`).
macro_rules! failure {
    ($($arg:tt)+) => { tracing::error!(target: $crate::log::TARGET, $($arg)+) };
}

pub(crate) use {failure, note, warning};

/// How the lines on stderr look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// `distlock: ...` lines for people.
    Text,
    /// One JSON object a line: timestamp, level, target, message and the
    /// event's fields (key, fencing, reason, ...).
    Json,
}

/// The logging flags, accepted before or after the subcommand.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// Print only errors (why distlock failed): no note for a skipped run or
    /// a wait, no warnings.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Say more: -v adds the library's info events (a lock acquired), -vv
    /// debug, -vvv trace. Without -q or -v, RUST_LOG (e.g.
    /// RUST_LOG=distlock_core=debug) replaces the default levels.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// `text` for people, `json` for log collectors (one object a line).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, value_name = "FORMAT")]
    log_format: LogFormat,
}

/// The filter directives for `-q` / the default / `-v`, `-vv`, `-vvv`.
/// A directive matches its target as a prefix: `distlock` covers every
/// distlock crate, `distlock_cli` (longer, so it wins) this binary's lines.
fn directives(quiet: bool, verbose: u8) -> &'static str {
    match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "error,distlock=warn,distlock_cli=info",
        (false, 1) => "warn,distlock=info,distlock_cli=debug",
        (false, 2) => "info,distlock=debug,distlock_cli=debug",
        (false, _) => "debug,distlock=trace,distlock_cli=trace",
    }
}

/// Installs the subscriber for the rest of the process. A `RUST_LOG` that
/// does not parse is reported (once the default is installed) and ignored.
pub fn install(args: &LogArgs) {
    let mut bad_rust_log = None;
    let filter = if args.quiet || args.verbose > 0 {
        EnvFilter::new(directives(args.quiet, args.verbose))
    } else {
        match std::env::var("RUST_LOG") {
            Ok(value) if !value.trim().is_empty() => {
                EnvFilter::try_new(&value).unwrap_or_else(|e| {
                    bad_rust_log = Some((value, e.to_string()));
                    EnvFilter::new(directives(false, 0))
                })
            }
            _ => EnvFilter::new(directives(false, 0)),
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Another subscriber already installed is not possible in this binary;
    // ignore the error rather than fail a run over its log lines.
    let _ = match args.log_format {
        LogFormat::Text => builder.event_format(TextFormat).try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .try_init(),
    };
    if let Some((value, error)) = bad_rust_log {
        warning!("ignoring RUST_LOG={value:?} ({error}); using the default levels");
    }
}

/// The text lines: `distlock: MESSAGE` for distlock's own notes and
/// errors, `distlock: warning: MESSAGE` for its warnings, and
/// `distlock: LEVEL: MESSAGE (field=value ...)` for the library's events
/// (debug and trace ones also name their target and spans).
struct TextFormat;

impl<S, N> FormatEvent<S, N> for TextFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let level = *meta.level();
        let own = meta.target() == TARGET;
        let mut fields = TextFields::default();
        event.record(&mut fields);
        write!(writer, "distlock: ")?;
        let label = match level {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        if !(own && matches!(level, Level::INFO | Level::ERROR)) {
            write!(writer, "{label}: ")?;
        }
        write!(writer, "{}", fields.message)?;
        // distlock's own messages say everything in words; their fields
        // are for the JSON lines.
        if !own && !fields.rest.is_empty() {
            write!(writer, " ({})", fields.rest)?;
        }
        if level >= Level::DEBUG {
            write!(writer, " [{}", meta.target())?;
            if let Some(scope) = ctx.event_scope() {
                for span in scope.from_root() {
                    write!(writer, " in {}", span.name())?;
                    let extensions = span.extensions();
                    if let Some(fields) = extensions.get::<FormattedFields<N>>() {
                        if !fields.is_empty() {
                            write!(writer, "{{{fields}}}")?;
                        }
                    }
                }
            }
            write!(writer, "]")?;
        }
        writeln!(writer)
    }
}

/// An event's message and its other fields as `name=value`.
#[derive(Default)]
struct TextFields {
    message: String,
    rest: String,
}

impl TextFields {
    fn push(&mut self, field: &Field, value: fmt::Arguments<'_>) {
        if field.name() == "message" {
            let _ = self.message.write_fmt(value);
        } else {
            if !self.rest.is_empty() {
                self.rest.push(' ');
            }
            let _ = write!(self.rest, "{}={value}", field.name());
        }
    }
}

impl Visit for TextFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, format_args!("{value}"));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field, format_args!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::directives;
    use tracing_subscriber::EnvFilter;

    #[test]
    fn every_level_set_parses() {
        for (quiet, verbose) in [(true, 0), (false, 0), (false, 1), (false, 2), (false, 3)] {
            EnvFilter::try_new(directives(quiet, verbose)).expect("valid directives");
        }
    }
}
