//! Lock-server URLs, parsed once for every backend: scheme, hosts,
//! credentials, path and query parameters.

use std::fmt;
use std::time::Duration;

use crate::LockError;

/// One `host[:port]` of a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlHost {
    /// The host name or address (IPv6 without its brackets).
    pub name: String,
    /// The port, if the URL gave one.
    pub port: Option<u16>,
}

impl UrlHost {
    /// `host:port`, with `default_port` when the URL gave none (IPv6 in
    /// brackets).
    pub fn address(&self, default_port: u16) -> String {
        let port = self.port.unwrap_or(default_port);
        if self.name.contains(':') {
            format!("[{}]:{port}", self.name)
        } else {
            format!("{}:{port}", self.name)
        }
    }
}

/// A parsed lock-server URL:
/// `scheme://[user[:password]@]host[:port][,host[:port]...][/path][?name=value&...]`.
///
/// User, password, path and parameter values are percent-decoded. As in
/// RFC 3986 and the WHATWG URL standard, the host part ends at the first
/// `/`, `?` or `#`, and the user information is everything before its
/// last `@`: a password may hold `@` and `:` as they are, but `/`, `?`
/// and `#` must be percent-encoded (`%2F`, `%3F`, `%23`). A URL with an
/// `@` after its host part (such a password, unencoded) is refused
/// without echoing any of it. A backend
/// *takes* the parameters it understands; [`finish`](Self::finish) then
/// refuses any left over, naming it, so a typo never passes silently.
/// `Display` and `Debug` never show the password.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::LockUrl;
/// let mut url = LockUrl::parse("etcd://locker:p%40ss@10.0.0.1:2379,10.0.0.2/?namespace=jobs&operation_timeout_ms=250")?;
/// assert_eq!(url.scheme(), "etcd");
/// assert_eq!(url.username(), Some("locker"));
/// assert_eq!(url.password(), Some("p@ss"));
/// assert_eq!(url.hosts()[1].address(2379), "10.0.0.2:2379");
/// let options = url.take_client_options()?;
/// assert_eq!(options.namespace(), "jobs");
/// assert_eq!(options.operation_timeout(), Duration::from_millis(250));
/// assert!(!url.to_string().contains("p@ss"));
/// url.finish()?;
///
/// let mut typo = LockUrl::parse("redis://127.0.0.1/?namspace=jobs")?;
/// typo.take_client_options()?;
/// let err = typo.finish().unwrap_err();
/// assert!(err.to_string().contains("namspace"));
/// # Ok::<(), distlock_core::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct LockUrl {
    scheme: String,
    username: Option<String>,
    password: Option<String>,
    hosts: Vec<UrlHost>,
    path: String,
    params: Vec<(String, String)>,
    asked: Vec<&'static str>,
}

impl LockUrl {
    /// Parses `url`. Errors are [`ErrorKind::Config`](crate::ErrorKind)
    /// and never echo the password.
    pub fn parse(url: &str) -> Result<Self, LockError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(LockError::config(format!(
                "{:?} is not a lock URL; expected scheme://host[:port]... (e.g. redis://127.0.0.1:6379)",
                redact_raw(url)
            )));
        };
        if scheme.is_empty()
            || !scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        {
            return Err(LockError::config(format!(
                "{:?} has an invalid scheme {scheme:?}",
                redact_raw(url)
            )));
        }
        // The authority ends at the first '/', '?' or '#' (RFC 3986, WHATWG);
        // its user information is everything before its last '@'.
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        if tail.contains('@') {
            // A raw '@' after the host part: a password (or user name)
            // holding '/', '?' or '#' unencoded. Nothing of it may be
            // echoed, so the error shows only what follows the last '@'.
            return Err(LockError::config(format!(
                "{:?} has an '@' after its host part: percent-encode '/', '?', '#' and '@' in the user name and password (%2F, %3F, %23, %40), and '@' in parameter values",
                redact_raw(url)
            )));
        }
        let (tail, fragment) = match tail.split_once('#') {
            Some((tail, fragment)) => (tail, Some(fragment)),
            None => (tail, None),
        };
        if fragment.is_some() {
            return Err(LockError::config(format!(
                "{:?} has a '#' fragment, which lock URLs do not use; remove it (percent-encode '#' as %23 in a password)",
                redact_raw(url)
            )));
        }
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let path = path.strip_prefix('/').unwrap_or(path);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let (username, password) = match userinfo {
            None => (None, None),
            Some(info) => {
                let (user, password) = match info.split_once(':') {
                    Some((user, password)) => (user, Some(password)),
                    None => (info, None),
                };
                let user = decode(user, "the user name")?;
                let password = password.map(|p| decode(p, "the password")).transpose()?;
                ((!user.is_empty()).then_some(user), password)
            }
        };
        let hosts = if hosts.is_empty() {
            Vec::new()
        } else {
            hosts
                .split(',')
                .map(parse_host)
                .collect::<Result<Vec<_>, _>>()?
        };
        let mut params = Vec::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name = decode(name, "a parameter name")?;
            let value = decode(value, &format!("parameter {name}"))?;
            if params.iter().any(|(n, _)| *n == name) {
                return Err(LockError::config(format!(
                    "URL parameter {name} is given twice; give it once"
                )));
            }
            params.push((name, value));
        }
        Ok(Self {
            scheme: scheme.to_ascii_lowercase(),
            username,
            password,
            hosts,
            path: decode(path, "the path")?,
            params,
            asked: Vec::new(),
        })
    }

    /// The scheme, lowercased (`redis`, `etcds`, `postgres`, ...).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// The user name, if the URL has one (percent-decoded).
    pub fn username(&self) -> Option<&str> {
        self.username.as_deref()
    }

    /// The password, if the URL has one (percent-decoded).
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The hosts, in order (several for a cluster).
    pub fn hosts(&self) -> &[UrlHost] {
        &self.hosts
    }

    /// The path after the hosts, without its leading `/` (a database name
    /// or number), percent-decoded; empty if none.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Takes parameter `name` if present. Every name asked for is listed as
    /// accepted by [`finish`](Self::finish)'s error.
    pub fn take(&mut self, name: &'static str) -> Option<String> {
        if !self.asked.contains(&name) {
            self.asked.push(name);
        }
        let at = self.params.iter().position(|(n, _)| n == name)?;
        Some(self.params.remove(at).1)
    }

    /// Takes a whole number of milliseconds.
    pub fn take_millis(&mut self, name: &'static str) -> Result<Option<Duration>, LockError> {
        Ok(self.take_u64(name)?.map(Duration::from_millis))
    }

    /// Takes a non-negative whole number.
    pub fn take_u64(&mut self, name: &'static str) -> Result<Option<u64>, LockError> {
        self.take(name)
            .map(|value| {
                value.parse::<u64>().map_err(|_| {
                    LockError::config(format!(
                        "URL parameter {name}={value:?} is not a non-negative whole number"
                    ))
                })
            })
            .transpose()
    }

    /// Takes a boolean (`true`/`false`, `1`/`0`, `on`/`off`, `yes`/`no`).
    pub fn take_bool(&mut self, name: &'static str) -> Result<Option<bool>, LockError> {
        self.take(name)
            .map(|value| match value.to_ascii_lowercase().as_str() {
                "true" | "1" | "on" | "yes" => Ok(true),
                "false" | "0" | "off" | "no" => Ok(false),
                _ => Err(LockError::config(format!(
                    "URL parameter {name}={value:?} is not a boolean; use true or false"
                ))),
            })
            .transpose()
    }

    /// Takes the parameters every backend shares (`namespace`,
    /// `connect_timeout_ms`, `operation_timeout_ms`, and the TLS files
    /// `tls_ca_file`, `tls_cert_file`, `tls_key_file`) into
    /// [`ClientOptions`](crate::ClientOptions), validated.
    pub fn take_client_options(&mut self) -> Result<crate::ClientOptions, LockError> {
        let mut options = crate::ClientOptions::default();
        if let Some(namespace) = self.take("namespace") {
            options = options.with_namespace(namespace);
        }
        if let Some(timeout) = self.take_millis("connect_timeout_ms")? {
            options = options.with_connect_timeout(timeout);
        }
        if let Some(timeout) = self.take_millis("operation_timeout_ms")? {
            options = options.with_operation_timeout(timeout);
        }
        options = options.with_tls(self.take_tls_files());
        options.validate()?;
        Ok(options)
    }

    /// Takes the TLS files every backend shares (`tls_ca_file`,
    /// `tls_cert_file`, `tls_key_file`), unchecked (see
    /// [`TlsFiles::validate`](crate::TlsFiles::validate)).
    pub fn take_tls_files(&mut self) -> crate::TlsFiles {
        let mut files = crate::TlsFiles::default();
        if let Some(path) = self.take("tls_ca_file") {
            files = files.with_ca_file(path);
        }
        if let Some(path) = self.take("tls_cert_file") {
            files = files.with_cert_file(path);
        }
        if let Some(path) = self.take("tls_key_file") {
            files = files.with_key_file(path);
        }
        files
    }

    /// Refuses the parameters nobody took, naming them and the accepted ones.
    pub fn finish(self) -> Result<(), LockError> {
        if self.params.is_empty() {
            return Ok(());
        }
        let unknown: Vec<&str> = self.params.iter().map(|(n, _)| n.as_str()).collect();
        let mut accepted = self.asked.clone();
        accepted.sort_unstable();
        Err(LockError::config(format!(
            "unknown {} URL parameter{} {}; accepted: {}",
            self.scheme,
            if unknown.len() == 1 { "" } else { "s" },
            unknown.join(", "),
            if accepted.is_empty() {
                "none".to_owned()
            } else {
                accepted.join(", ")
            }
        )))
    }

    /// Refuses a scheme not in `schemes`, naming the backend.
    pub fn expect_scheme(&self, backend: &str, schemes: &[&str]) -> Result<(), LockError> {
        if schemes.contains(&self.scheme.as_str()) {
            Ok(())
        } else {
            Err(LockError::config(format!(
                "{self} is not a {backend} URL; use {}",
                schemes
                    .iter()
                    .map(|s| format!("{s}://"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )))
        }
    }
}

impl fmt::Display for LockUrl {
    /// The URL without password or parameters (for messages and logs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://", self.scheme)?;
        if let Some(user) = &self.username {
            write!(f, "{user}")?;
        }
        if self.password.is_some() {
            f.write_str(":***")?;
        }
        if self.username.is_some() || self.password.is_some() {
            f.write_str("@")?;
        }
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|h| match h.port {
                Some(port) => UrlHost {
                    name: h.name.clone(),
                    port: Some(port),
                }
                .address(port),
                None if h.name.contains(':') => format!("[{}]", h.name),
                None => h.name.clone(),
            })
            .collect();
        f.write_str(&hosts.join(","))?;
        if !self.path.is_empty() {
            write!(f, "/{}", self.path)?;
        }
        Ok(())
    }
}

impl fmt::Debug for LockUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockUrl")
            .field("url", &self.to_string())
            .field(
                "params",
                &self.params.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn parse_host(text: &str) -> Result<UrlHost, LockError> {
    let (name, port) = if let Some(rest) = text.strip_prefix('[') {
        let Some((name, after)) = rest.split_once(']') else {
            return Err(LockError::config(format!(
                "host {text:?} opens '[' without closing it"
            )));
        };
        match after.strip_prefix(':') {
            Some(port) => (name, Some(port)),
            None if after.is_empty() => (name, None),
            None => {
                return Err(LockError::config(format!(
                    "host {text:?}: expected ':port' after ']'"
                )))
            }
        }
    } else {
        match text.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (text, None),
        }
    };
    if name.is_empty() {
        return Err(LockError::config(format!(
            "host {text:?} has no name; use host:port"
        )));
    }
    let port = port
        .map(|p| {
            p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                LockError::config(format!("host {text:?} has an invalid port {p:?}"))
            })
        })
        .transpose()?;
    Ok(UrlHost {
        name: decode(name, "a host name")?,
        port,
    })
}

/// Percent-decodes `text` as UTF-8; `what` names it in the error.
fn decode(text: &str, what: &str) -> Result<String, LockError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = hex else {
                return Err(LockError::config(format!(
                    "{what} in the URL has a bad percent escape; write '%' as %25"
                )));
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| LockError::config(format!("{what} in the URL is not UTF-8 once decoded")))
}

/// `url` with everything between `://` and its last `@` replaced by `***`,
/// for errors about URLs that did not parse. The last `@` anywhere, not
/// the authority's: a password holding an unencoded `/`, `?` or `#` ends
/// the authority early, and none of it may show.
fn redact_raw(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    match (scheme, rest.rfind('@')) {
        (Some(scheme), Some(at)) => format!("{scheme}://***@{}", &rest[at + 1..]),
        (None, Some(at)) => format!("***@{}", &rest[at + 1..]),
        (_, None) => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn parses_every_part() {
        let url = LockUrl::parse("Redis://u%3Ax:p%2Fw@[::1]:7000,h2/3?a=1&b=%26").unwrap();
        assert_eq!(url.scheme(), "redis");
        assert_eq!(url.username(), Some("u:x"));
        assert_eq!(url.password(), Some("p/w"));
        assert_eq!(
            url.hosts(),
            [
                UrlHost {
                    name: "::1".into(),
                    port: Some(7000)
                },
                UrlHost {
                    name: "h2".into(),
                    port: None
                }
            ]
        );
        assert_eq!(url.hosts()[0].address(1), "[::1]:7000");
        assert_eq!(url.path(), "3");
        let mut url = url;
        assert_eq!(url.take("b").as_deref(), Some("&"));
        assert_eq!(url.take("a").as_deref(), Some("1"));
        url.finish().unwrap();
    }

    #[test]
    fn password_only_and_empty_hosts() {
        let url = LockUrl::parse("redis://:secret@127.0.0.1").unwrap();
        assert_eq!(url.username(), None);
        assert_eq!(url.password(), Some("secret"));
        assert_eq!(url.to_string(), "redis://:***@127.0.0.1");
        assert!(!format!("{url:?}").contains("secret"));
        let url = LockUrl::parse("postgres:///db").unwrap();
        assert!(url.hosts().is_empty());
        assert_eq!(url.path(), "db");
    }

    #[test]
    fn errors_are_config_and_redacted() {
        for bad in [
            "no-scheme",
            "redis://u:pw@h:99999",
            "redis://u:pw@h:x",
            "redis://u:p%zzw@h",
            "redis://h/?a=1&a=2",
            "redis://[::1",
            "re dis://h",
        ] {
            let err = LockUrl::parse(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad}");
            assert!(!err.to_string().contains("pw"), "{bad}: {err}");
        }
    }

    /// Passwords with every character that ends a URL part: percent-encoded
    /// they are taken whole; '@' and ':' work as they are.
    #[test]
    fn passwords_with_delimiters() {
        for (url, password) in [
            ("redis://u:a%2Fb%3Fc%23d%40e%3Af@h:1/2?x=1", "a/b?c#d@e:f"),
            ("redis://u:my%2Fsecretpw@h", "my/secretpw"),
            ("redis://u:p@ss@h/0", "p@ss"),
            ("redis://u:a:b:c@h", "a:b:c"),
            ("redis://u:@:@@h", "@:@"),
            ("postgres://u:%23%3F%2F@h/db?sslmode=disable", "#?/"),
        ] {
            let parsed = LockUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(parsed.username(), Some("u"), "{url}");
            assert_eq!(parsed.password(), Some(password), "{url}");
            assert_eq!(parsed.hosts()[0].name, "h", "{url}");
            assert!(!parsed.to_string().contains(password), "{url}: {parsed}");
            assert!(!format!("{parsed:?}").contains(password), "{url}");
        }
    }

    /// A password holding '/', '?' or '#' unencoded ends the host part
    /// early: the URL is refused, and no error shows any of it (nor of the
    /// user name).
    #[test]
    fn unencoded_delimiters_in_passwords_never_echoed() {
        for (url, secrets) in [
            (
                "redis://user:1234/SECRETPART@host",
                &["1234", "SECRETPART", "user:"][..],
            ),
            (
                "redis://user:my/secretpw@host:6379/0",
                &[":my", "my/", "secretpw"],
            ),
            ("redis://user:pa?xyzzy@host", &["pa?", "xyzzy"]),
            ("redis://user:pa#xyzzy@host", &["pa#", "xyzzy"]),
            (
                "redis://user:a/b?c#d@e@host/1?namespace=x",
                &["a/b", "c#d", "d@e", "user:"],
            ),
            (
                "etcd://user:x/y@h1:2379,h2?operation_timeout_ms=5",
                &["x/y", "user:"],
            ),
        ] {
            let err = LockUrl::parse(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            let message = err.to_string();
            for secret in secrets {
                assert!(
                    !message.contains(secret),
                    "{url}: {message:?} shows {secret:?}"
                );
            }
            assert!(message.contains("percent-encode"), "{url}: {message}");
        }
        // Every other error of a URL with credentials hides them too.
        for url in [
            "redis://user:my/pw@h:99999",
            "redis://user:my?pw@[::1",
            "redis://user:s3cr%zzet@h",
            "redis://user:s3cret@h#frag",
        ] {
            let err = LockUrl::parse(url).unwrap_err();
            let message = err.to_string();
            for secret in ["my/", "my?", "pw", "s3cr", "user:"] {
                assert!(
                    !message.contains(secret),
                    "{url}: {message:?} shows {secret:?}"
                );
            }
        }
    }

    #[test]
    fn typed_parameters() {
        let mut url = LockUrl::parse("x://h?ms=10&flag=off&n=x").unwrap();
        assert_eq!(
            url.take_millis("ms").unwrap(),
            Some(Duration::from_millis(10))
        );
        assert_eq!(url.take_bool("flag").unwrap(), Some(false));
        assert!(url.take_u64("n").is_err());
        assert_eq!(url.take_u64("missing").unwrap(), None);
        url.finish().unwrap();
    }

    #[test]
    fn unknown_parameters_are_named() {
        let mut url = LockUrl::parse("etcd://h?namespace=a&bogus=1").unwrap();
        url.take_client_options().unwrap();
        let err = url.finish().unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
        assert!(err.to_string().contains("namespace"), "{err}");
    }
}
