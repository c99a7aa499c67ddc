//! URL pieces the harness and tests build: percent-encoded values and the
//! `namespace=` parameter.

/// `text` with every byte but ASCII letters and digits percent-encoded, for
/// a URL's query value or credentials (a URL inside a URL, a file path, a
/// password with `@`).
///
/// ```
/// use distlock_conformance::url::percent_encode;
/// assert_eq!(percent_encode("a/b c@d"), "a%2Fb%20c%40d");
/// ```
pub fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// `url` with its `namespace=` query parameter set to `namespace`: an
/// existing one is replaced, else it is appended (after `?` or `&`).
///
/// ```
/// use distlock_conformance::with_namespace;
/// assert_eq!(with_namespace("redis://h:1", "a"), "redis://h:1?namespace=a");
/// assert_eq!(
///     with_namespace("redis://h:1?namespace=x&operation_timeout_ms=9", "a"),
///     "redis://h:1?namespace=a&operation_timeout_ms=9"
/// );
/// assert_eq!(with_namespace("", "a"), "?namespace=a");
/// ```
pub fn with_namespace(url: &str, namespace: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some("namespace"))
        .map(str::to_owned)
        .collect();
    params.insert(0, format!("namespace={namespace}"));
    format!("{base}?{}", params.join("&"))
}

/// The `namespace=` parameter of a URL the suite gave a client factory, if
/// it has one: what the factory of an in-process backend declared with
/// [`Suite::namespaces`](crate::Suite::namespaces) keys its servers by.
///
/// ```
/// use distlock_conformance::namespace_of;
/// assert_eq!(namespace_of("?namespace=a"), Some("a"));
/// assert_eq!(namespace_of("redis://h?x=1&namespace=b"), Some("b"));
/// assert_eq!(namespace_of(""), None);
/// ```
pub fn namespace_of(url: &str) -> Option<&str> {
    let (_, query) = url.split_once('?')?;
    query.split('&').find_map(|p| p.strip_prefix("namespace="))
}
