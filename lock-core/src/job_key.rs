//! Stable lock keys derived from a job name and its arguments, as
//! celery-singleton and celery-once do.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{LockError, LockKey, MAX_KEY_BYTES};

/// Bytes of the argument hash in a derived key (hex, 128 bits).
const HASH_HEX_LEN: usize = 32;

/// Builds the lock key of a job run from its name and arguments.
///
/// Arguments are serialized canonically (map keys sorted at every depth,
/// compact JSON) and hashed with SHA-256, so the same arguments give the same
/// key on every machine and every run, whatever their order or length.
///
/// ```
/// use serde_json::json;
/// use distlock_core::JobKey;
/// let a = JobKey::new("send_invoice").args(&json!({"customer": 7, "month": "2026-11"}))?.key()?;
/// let b = JobKey::new("send_invoice").args(&json!({"month": "2026-11", "customer": 7}))?.key()?;
/// assert_eq!(a, b);
/// // Only some arguments count: every retry id maps to the same key.
/// let c = JobKey::new("send_invoice")
///     .args(&json!({"customer": 7, "month": "2026-11", "retry_id": "x1"}))?
///     .only(&["customer", "month"])
///     .key()?;
/// assert_eq!(a, c);
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Debug, Clone)]
pub struct JobKey {
    name: String,
    args: Option<Value>,
    only: Option<Vec<String>>,
}

impl JobKey {
    /// A key for the job `name` (no arguments yet).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            args: None,
            only: None,
        }
    }

    /// The job's arguments: any `Serialize` value (a struct, a map, a tuple).
    pub fn args<A: Serialize + ?Sized>(mut self, args: &A) -> Result<Self, LockError> {
        let value = serde_json::to_value(args).map_err(|e| {
            LockError::invalid_input(format!("job arguments cannot be serialized: {e}"))
        })?;
        self.args = Some(value);
        Ok(self)
    }

    /// Only these top-level fields of the arguments count for the key.
    pub fn only(mut self, fields: &[&str]) -> Self {
        self.only = Some(fields.iter().map(|f| (*f).to_owned()).collect());
        self
    }

    /// The canonical text of the counted arguments (what is hashed).
    pub fn canonical_args(&self) -> String {
        let mut out = String::new();
        if let Some(args) = &self.args {
            let args = match (&self.only, args) {
                (Some(only), Value::Object(map)) => Value::Object(
                    map.iter()
                        .filter(|(k, _)| only.iter().any(|o| o == *k))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                ),
                _ => args.clone(),
            };
            write_canonical(&args, &mut out);
        }
        out
    }

    /// The lock key: `name:<32 hex chars of SHA-256 of the arguments>`, or
    /// just `name` without arguments.
    pub fn key(&self) -> Result<LockKey, LockError> {
        if self.args.is_none() {
            return LockKey::new(self.name.clone());
        }
        if self.name.len() + 1 + HASH_HEX_LEN > MAX_KEY_BYTES {
            return Err(LockError::invalid_input(format!(
                "job name is {} bytes; with the argument hash the key must stay within {MAX_KEY_BYTES}",
                self.name.len()
            )));
        }
        let digest = Sha256::digest(self.canonical_args().as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        LockKey::new(format!("{}:{}", self.name, &hex[..HASH_HEX_LEN]))
    }
}

/// Compact JSON with object keys sorted at every depth (independent of
/// serde_json's `preserve_order` feature, which another crate may enable).
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn stable_across_processes() {
        // A fixed expected key (computed independently with Python's hashlib):
        // changing the canonical form or the hash would
        // split running fleets, so it must never change silently.
        let key = JobKey::new("report")
            .args(&json!({"b": [1, {"y": 2, "x": 1}], "a": "é"}))
            .unwrap()
            .key()
            .unwrap();
        let canonical = r#"{"a":"é","b":[1,{"x":1,"y":2}]}"#;
        let digest = Sha256::digest(canonical.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(key.as_str(), format!("report:{}", &hex[..32]));
        assert_eq!(key.as_str(), "report:7d3c8b032ac468d2d8d4df08d101faa3");
    }

    #[test]
    fn python_binding_key_pinned() {
        // The Python package's `job_key("tasks.send_invoice", [7],
        // {"month": "2026-11", "retry_id": "x1"}, only=[0, "month"])` hashes
        // positional arguments under their index; python/tests pins the same
        // key (computed independently with hashlib over
        // {"0":7,"month":"2026-11"}).
        let key = JobKey::new("tasks.send_invoice")
            .args(&json!({"0": 7, "month": "2026-11", "retry_id": "x1"}))
            .unwrap()
            .only(&["0", "month"])
            .key()
            .unwrap();
        assert_eq!(
            key.as_str(),
            "tasks.send_invoice:eec490f9a2834d2eaf90d81bfb820aef"
        );
    }

    #[test]
    fn long_arguments_fit() {
        let big = "x".repeat(10_000);
        let key = JobKey::new("j")
            .args(&json!({ "blob": big }))
            .unwrap()
            .key()
            .unwrap();
        assert!(key.as_str().len() <= MAX_KEY_BYTES);
        assert!(JobKey::new("n".repeat(500))
            .args(&1)
            .unwrap()
            .key()
            .is_err());
    }

    #[test]
    fn selected_arguments_and_order() {
        #[derive(serde::Serialize)]
        struct Args {
            customer: u32,
            attempt: u32,
        }
        let a = JobKey::new("j")
            .args(&Args {
                customer: 1,
                attempt: 1,
            })
            .unwrap()
            .only(&["customer"])
            .key()
            .unwrap();
        let b = JobKey::new("j")
            .args(&Args {
                customer: 1,
                attempt: 2,
            })
            .unwrap()
            .only(&["customer"])
            .key()
            .unwrap();
        let c = JobKey::new("j")
            .args(&Args {
                customer: 2,
                attempt: 1,
            })
            .unwrap()
            .only(&["customer"])
            .key()
            .unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let all1 = JobKey::new("j")
            .args(&Args {
                customer: 1,
                attempt: 1,
            })
            .unwrap()
            .key()
            .unwrap();
        let all2 = JobKey::new("j")
            .args(&Args {
                customer: 1,
                attempt: 2,
            })
            .unwrap()
            .key()
            .unwrap();
        assert_ne!(all1, all2);
    }
}
