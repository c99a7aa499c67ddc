//! Human durations on the command line: `30s`, `500ms`, `2m`, `1h`, `1m30s`.

use std::time::Duration;

/// Parses `500ms`, `30s`, `2m`, `1h`, `1d` and sums like `1m30s`. A bare
/// number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration; use e.g. 30s, 500ms, 2m or 1h".into());
    }
    if let Ok(secs) = text.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!(
                "{text:?} is not a duration; use e.g. 30s, 500ms, 2m or 1h"
            ));
        }
        let number: f64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{text:?} is not a duration; use e.g. 30s, 500ms, 2m or 1h"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let seconds_per_unit = match unit {
            "ms" => 0.001,
            "s" | "sec" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            "" => {
                return Err(format!(
                    "{text:?} is missing a unit; use e.g. 30s, 500ms, 2m or 1h"
                ))
            }
            other => {
                return Err(format!(
                    "unknown unit {other:?} in {text:?}; use ms, s, m, h or d"
                ))
            }
        };
        let part = Duration::try_from_secs_f64(number * seconds_per_unit)
            .map_err(|_| format!("{text:?} is out of range"))?;
        total = total
            .checked_add(part)
            .ok_or_else(|| format!("{text:?} is out of range"))?;
    }
    Ok(total)
}

/// Formats a duration for messages: `1.5s`, `250ms`, `2m05s`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else {
        let secs = d.as_secs();
        if secs < 3600 {
            format!("{}m{:02}s", secs / 60, secs % 60)
        } else {
            format!("{}h{:02}m", secs / 3600, (secs % 3600) / 60)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("5.").is_err());
        assert!(parse_duration("1.5.3s").is_err());
        assert!(parse_duration("1e400s").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_secs(125)), "2m05s");
    }
}
