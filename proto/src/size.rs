//! Human-readable byte sizes: `512M`, `64G`, `1.5GiB`, `4096`.

/// Why a size did not parse; the message names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {why}")]
pub struct SizeError {
    pub input: String,
    pub why: String,
}

/// Parses a size: a number (decimals allowed) and an optional binary unit `K`, `M`, `G`, `T`,
/// `P` (each may be followed by `i`/`iB`/`B`; case-insensitive). A bare number is bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let fail = |why: String| SizeError {
        input: s.into(),
        why,
    };
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.matches('.').count() > 1 || num.starts_with('.') || num.ends_with('.')
    {
        return Err(fail(
            "expected a number with an optional unit, like 512M or 64G".into(),
        ));
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "ki" | "kib" => 10,
        "m" | "mb" | "mi" | "mib" => 20,
        "g" | "gb" | "gi" | "gib" => 30,
        "t" | "tb" | "ti" | "tib" => 40,
        "p" | "pb" | "pi" | "pib" => 50,
        other => {
            return Err(fail(format!(
                "unknown unit {other:?} (use K, M, G, T or P)"
            )))
        }
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let too_big = || fail("too large".into());
    let int: u64 = int.parse().map_err(|_| too_big())?;
    let mut bytes = int.checked_mul(1u64 << shift).ok_or_else(too_big)?;
    if !frac.is_empty() {
        if frac.len() > 9 {
            return Err(fail("at most 9 decimal places".into()));
        }
        let f: u64 = frac.parse().map_err(|_| too_big())?;
        let scale = 10u128.pow(frac.len() as u32);
        let extra = (f as u128 * (1u128 << shift)) / scale;
        bytes = bytes.checked_add(extra as u64).ok_or_else(too_big)?;
    }
    Ok(bytes)
}

/// Formats bytes with a binary unit, e.g. `1.50 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("64G").unwrap(), 64 << 30);
        assert_eq!(parse_size("64gib").unwrap(), 64 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 2KiB ").unwrap(), 2048);
        for bad in [
            "",
            "G",
            "12X",
            "1..5G",
            ".5G",
            "5.G",
            "-1G",
            "99999999999P",
            "1.5.5",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should not parse");
        }
        assert_eq!(format_size(1536 << 20), "1.50 GiB");
        assert_eq!(format_size(100), "100 B");
    }

    proptest! {
        #[test]
        fn integers_with_units_round_trip(n in 0u64..1_000_000, u in 0usize..5) {
            let units = ["", "K", "M", "G", "T"];
            let s = format!("{n}{}", units[u]);
            prop_assert_eq!(parse_size(&s).unwrap(), n << (10 * u as u32));
        }

        #[test]
        fn never_panics(s in ".{0,20}") {
            let _ = parse_size(&s);
        }
    }
}
