//! When the writer calls `fsync`, traded off against throughput.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How eagerly [`crate::SpoolWriter`] makes appended records durable.
///
/// Whatever the policy, a record whose `append` returned is in the OS page cache and survives
/// the *process* crashing; the policy only decides what survives a kernel crash or power loss.
///
/// Parsed from (and displayed as) `always`, `never`, or an interval such as `100ms`, `1s`,
/// `interval:250ms`, so a CLI can take `--fsync always|never|<duration>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// `fdatasync` after every append: once `append` returns, the record survives power loss.
    /// Costs one disk flush per call (use `append_batch` to amortize it).
    Always,
    /// `fdatasync` at most once per interval while there are unsynced bytes: on power loss at
    /// most about one interval of records is lost. The sync happens on the next append after the
    /// interval has passed, or when the owner calls `sync_if_due` (do so when idle, see
    /// `SpoolWriter::sync_deadline`), and always on `sync()` and on drop.
    Interval(Duration),
    /// Never fsync on the append path (only an explicit `sync()` does): the OS writes back when
    /// it likes (typically within 30 s), so power loss can lose that much.
    Never,
}

impl Default for FsyncPolicy {
    fn default() -> Self {
        FsyncPolicy::Interval(Duration::from_millis(100))
    }
}

/// Why a `--fsync` value was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fsync policy `{input}`: {reason}; expected `always`, `never` or an interval such as `100ms`, `1s` or `interval:250ms`")]
pub struct ParseFsyncPolicyError {
    input: String,
    reason: &'static str,
}

impl FromStr for FsyncPolicy {
    type Err = ParseFsyncPolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseFsyncPolicyError {
            input: s.to_owned(),
            reason,
        };
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "always" => return Ok(FsyncPolicy::Always),
            "never" => return Ok(FsyncPolicy::Never),
            _ => {}
        }
        let d = parse_duration(t.strip_prefix("interval:").unwrap_or(&t)).map_err(err)?;
        if d.is_zero() {
            return Err(err(
                "a zero interval would sync on every append; say `always`",
            ));
        }
        Ok(FsyncPolicy::Interval(d))
    }
}

/// `<number><unit>` with unit `us`, `ms`, `s` or `m`; the number may have a fraction (`1.5s`).
/// Integer arithmetic on nanoseconds, so `100ms` is exactly 100 ms (no float rounding).
pub fn parse_duration(s: &str) -> Result<Duration, &'static str> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err("not a keyword and does not start with a number");
    }
    let unit_ns: u128 = match unit.trim() {
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "" => return Err("the interval needs a unit (us, ms, s or m)"),
        _ => return Err("unknown unit (use us, ms, s or m)"),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits_ok = |d: &str| d.len() <= 18 && d.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !digits_ok(int) || !digits_ok(frac) {
        return Err("malformed number");
    }
    let int: u128 = int.parse().map_err(|_| "malformed number")?;
    let frac_ns = match frac {
        "" => 0,
        f => {
            f.parse::<u128>().map_err(|_| "malformed number")? * unit_ns
                / 10u128.pow(f.len() as u32)
        }
    };
    let nanos = int * unit_ns + frac_ns;
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| "interval out of range")?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

impl fmt::Display for FsyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            FsyncPolicy::Always => f.write_str("always"),
            FsyncPolicy::Never => f.write_str("never"),
            // The largest unit that represents the interval exactly, so Display round-trips.
            FsyncPolicy::Interval(d) if d.subsec_nanos() == 0 => write!(f, "{}s", d.as_secs()),
            FsyncPolicy::Interval(d) if d.subsec_nanos() % 1_000_000 == 0 => {
                write!(f, "{}ms", d.as_millis())
            }
            FsyncPolicy::Interval(d) => write!(f, "{}us", d.as_micros()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> FsyncPolicy {
        FsyncPolicy::Interval(Duration::from_millis(n))
    }

    #[test]
    fn parses_keywords_and_intervals() {
        let cases = [
            ("always", FsyncPolicy::Always),
            ("Never", FsyncPolicy::Never),
            (" always ", FsyncPolicy::Always),
            ("100ms", ms(100)),
            ("interval:100ms", ms(100)),
            ("1s", ms(1000)),
            ("1.5s", ms(1500)),
            ("2m", ms(120_000)),
            ("250us", FsyncPolicy::Interval(Duration::from_micros(250))),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<FsyncPolicy>(), Ok(want), "{input}");
        }
    }

    #[test]
    fn rejects_bad_input_with_a_clear_message() {
        for (input, needle) in [
            ("sometimes", "does not start with a number"),
            ("100", "needs a unit"),
            ("100h", "unknown unit"),
            ("1.2.3s", "malformed number"),
            ("0ms", "say `always`"),
            ("interval:", "does not start with a number"),
            ("", "does not start with a number"),
        ] {
            let msg = input.parse::<FsyncPolicy>().unwrap_err().to_string();
            assert!(msg.contains(needle), "{input}: {msg}");
            assert!(msg.contains(&format!("`{input}`")), "{msg}");
            assert!(msg.contains("expected `always`, `never`"), "{msg}");
        }
    }

    #[test]
    fn display_round_trips() {
        for p in [
            FsyncPolicy::Always,
            FsyncPolicy::Never,
            FsyncPolicy::default(),
            ms(1000),
            ms(1500),
            FsyncPolicy::Interval(Duration::from_micros(250)),
        ] {
            assert_eq!(p.to_string().parse::<FsyncPolicy>(), Ok(p), "{p}");
        }
        assert_eq!(FsyncPolicy::default().to_string(), "100ms");
    }
}
