//! Sizes and counts on the command line: 40GiB, 512MiB, 7B, 7e9; and human formatting.
//!
//! SIZE: a decimal number (optionally with a fraction or an exponent) and an optional unit:
//! `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000), `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024); units are
//! case-insensitive. Fractional byte results are rounded down (`1.3GiB`).
//! COUNT: a number with an optional suffix `k` (1e3), `M` (1e6), `B`/`G` (1e9), `T` (1e12), or an
//! exponent (`7e9`); the result must be a whole number.
//! Every value must be greater than zero and fit in 64 bits; arithmetic is exact (u128).

use thiserror::Error;

/// Why a size or count was rejected. Each variant names the input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UnitError {
    #[error("invalid size '{0}': expected a number with an optional unit, e.g. 40GiB, 40GB, 512MiB, 1.5TiB or plain bytes")]
    BadSize(String),
    #[error("invalid count '{0}': expected a whole number, e.g. 7e9, 7B, 350M, 1.5k or 12")]
    BadCount(String),
    #[error("'{0}' is not a whole number")]
    NotWhole(String),
    #[error("'{0}' must be greater than zero")]
    Zero(String),
    #[error("'{0}' is negative; sizes and counts must be greater than zero")]
    Negative(String),
    #[error("'{0}' is too large (does not fit in 64 bits)")]
    Overflow(String),
}

/// A parsed decimal: value = mantissa × 10^exp10 (exp10 may be negative).
struct Decimal {
    mantissa: u128,
    exp10: i32,
}

/// Parse `digits[.digits][e[+-]digits]` exactly. `None` on anything else.
fn parse_decimal(s: &str) -> Option<Result<Decimal, ()>> {
    let (num, exp) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let (int, frac) = match num.find('.') {
        Some(i) => (&num[..i], &num[i + 1..]),
        None => (num, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if !int.bytes().all(|c| c.is_ascii_digit()) || !frac.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut mantissa: u128 = 0;
    let mut overflow = false;
    for c in int.bytes().chain(frac.bytes()) {
        match mantissa
            .checked_mul(10)
            .and_then(|m| m.checked_add(u128::from(c - b'0')))
        {
            Some(m) => mantissa = m,
            None => overflow = true,
        }
    }
    let mut exp10: i64 = -(frac.len() as i64);
    if let Some(e) = exp {
        let (neg, digits) = match e.strip_prefix('-') {
            Some(d) => (true, d),
            None => (false, e.strip_prefix('+').unwrap_or(e)),
        };
        if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) || digits.len() > 4 {
            return None;
        }
        let v: i64 = digits.parse().ok()?;
        exp10 += if neg { -v } else { v };
    }
    if overflow || !(-60..=60).contains(&exp10) {
        return Some(Err(()));
    }
    Some(Ok(Decimal {
        mantissa,
        exp10: exp10 as i32,
    }))
}

/// mantissa × 10^exp10 × mult, exactly; Err(None) overflow, Ok((value, exact)).
fn scale(d: &Decimal, mult: u128) -> Option<(u128, bool)> {
    let mut num = d.mantissa.checked_mul(mult)?;
    if d.exp10 >= 0 {
        for _ in 0..d.exp10 {
            num = num.checked_mul(10)?;
        }
        Some((num, true))
    } else {
        let mut den: u128 = 1;
        for _ in 0..(-d.exp10) {
            den = den.checked_mul(10)?;
        }
        Some((num / den, num % den == 0))
    }
}

fn split_unit(s: &str) -> (&str, &str) {
    let idx = s
        .char_indices()
        .find(|&(i, c)| {
            c.is_ascii_alphabetic()
                && !((c == 'e' || c == 'E')
                    && s[i + 1..].starts_with(|n: char| n.is_ascii_digit() || n == '-' || n == '+'))
        })
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    (s[..idx].trim(), s[idx..].trim())
}

/// Parse a SIZE in bytes: `40GiB`, `40GB`, `512MiB`, `1.5TiB`, `1048576`.
pub fn parse_size(input: &str) -> Result<u64, UnitError> {
    let s = input.trim();
    if s.starts_with('-') {
        return Err(UnitError::Negative(input.to_string()));
    }
    let (num, unit) = split_unit(s);
    let mult: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(UnitError::BadSize(input.to_string())),
    };
    let d = match parse_decimal(num) {
        None => return Err(UnitError::BadSize(input.to_string())),
        Some(Err(())) => return Err(UnitError::Overflow(input.to_string())),
        Some(Ok(d)) => d,
    };
    let (v, _) = scale(&d, mult).ok_or_else(|| UnitError::Overflow(input.to_string()))?;
    finish(input, v)
}

/// Parse a COUNT: `7e9`, `7B`, `350M`, `1.5k`, `12`.
pub fn parse_count(input: &str) -> Result<u64, UnitError> {
    let s = input.trim();
    if s.starts_with('-') {
        return Err(UnitError::Negative(input.to_string()));
    }
    let (num, unit) = split_unit(s);
    let mult: u128 = match unit {
        "" => 1,
        "k" | "K" => 1_000,
        "m" | "M" => 1_000_000,
        "b" | "B" | "g" | "G" => 1_000_000_000,
        "t" | "T" => 1_000_000_000_000,
        _ => return Err(UnitError::BadCount(input.to_string())),
    };
    let d = match parse_decimal(num) {
        None => return Err(UnitError::BadCount(input.to_string())),
        Some(Err(())) => return Err(UnitError::Overflow(input.to_string())),
        Some(Ok(d)) => d,
    };
    let (v, exact) = scale(&d, mult).ok_or_else(|| UnitError::Overflow(input.to_string()))?;
    if !exact {
        return Err(UnitError::NotWhole(input.to_string()));
    }
    finish(input, v)
}

fn finish(input: &str, v: u128) -> Result<u64, UnitError> {
    if v == 0 {
        return Err(UnitError::Zero(input.to_string()));
    }
    u64::try_from(v).map_err(|_| UnitError::Overflow(input.to_string()))
}

/// Bytes for people, the one byte format every command prints: binary units with two decimals,
/// as PyTorch's own OOM messages print them (`1.50 GiB`, `512.00 MiB`, `12.00 KiB`), whole
/// bytes below 1 KiB (`100 B`).
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// Bytes in decimal gigabytes for people: `208.25 GB`.
pub fn fmt_gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

/// Counts for people: `124.44M`, `6.74B`, `1.50k`, `12`.
pub fn fmt_count(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("T", 1_000_000_000_000),
        ("B", 1_000_000_000),
        ("M", 1_000_000),
        ("k", 1_000),
    ];
    for (name, size) in UNITS {
        if n >= size {
            return format!("{:.2}{name}", n as f64 / size as f64);
        }
    }
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("40GiB"), Ok(40 << 30));
        assert_eq!(parse_size("40GB"), Ok(40_000_000_000));
        assert_eq!(parse_size("40gb"), Ok(40_000_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5TiB"), Ok(3 << 39));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("80 GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1e3"), Ok(1000));
        assert_eq!(
            parse_size("16EiB").unwrap_err(),
            UnitError::BadSize("16EiB".into())
        );
        assert!(matches!(parse_size("0GB"), Err(UnitError::Zero(_))));
        assert!(matches!(parse_size("-1GB"), Err(UnitError::Negative(_))));
        assert!(matches!(
            parse_size("99999999999TiB"),
            Err(UnitError::Overflow(_))
        ));
        assert!(matches!(
            parse_size("18446744073709551616"),
            Err(UnitError::Overflow(_))
        ));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert!(matches!(parse_size("lots"), Err(UnitError::BadSize(_))));
        assert!(matches!(parse_size(""), Err(UnitError::BadSize(_))));
        assert!(matches!(parse_size("1.2.3GB"), Err(UnitError::BadSize(_))));
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("7e9"), Ok(7_000_000_000));
        assert_eq!(parse_count("7B"), Ok(7_000_000_000));
        assert_eq!(parse_count("350M"), Ok(350_000_000));
        assert_eq!(parse_count("1.5k"), Ok(1500));
        assert_eq!(parse_count("12"), Ok(12));
        assert_eq!(parse_count("1.5e3"), Ok(1500));
        assert!(matches!(parse_count("1.5"), Err(UnitError::NotWhole(_))));
        assert!(matches!(parse_count("0"), Err(UnitError::Zero(_))));
        assert!(matches!(parse_count("-3"), Err(UnitError::Negative(_))));
        assert!(matches!(parse_count("1e30"), Err(UnitError::Overflow(_))));
        assert!(matches!(parse_count("7X"), Err(UnitError::BadCount(_))));
        assert!(matches!(parse_count("e9"), Err(UnitError::BadCount(_))));
        let msg = parse_count("abc").unwrap_err().to_string();
        assert!(msg.contains("'abc'"), "{msg}");
    }

    /// The user-facing byte and count formats (every table, report and message uses these two).
    #[test]
    fn formatting() {
        assert_eq!(fmt_bytes(3 << 29), "1.50 GiB");
        assert_eq!(fmt_bytes(40 << 30), "40.00 GiB");
        assert_eq!(fmt_bytes(200 << 30), "200.00 GiB");
        assert_eq!(fmt_bytes(512 << 20), "512.00 MiB");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(100), "100 B");
        assert_eq!(fmt_bytes(3 << 40), "3.00 TiB");
        assert_eq!(fmt_count(124_439_808), "124.44M");
        assert_eq!(fmt_count(7_000_000_000), "7.00B");
        assert_eq!(fmt_count(1_500), "1.50k");
        assert_eq!(fmt_count(999), "999");
    }
}
