//! A collective's measured latency-vs-size curve, as `flashoverlap tune`
//! samples it: piecewise linear between the samples, flat below the first
//! (latency-bound), the last segment's slope past the last (bandwidth-bound).
//!
//! Fixed capacity so that the hardware model stays `Copy`.

use crate::plan::error::PlanError;

/// Most samples a curve holds (4 KiB .. 1 GiB at every power of two is 19).
pub const CURVE_CAPACITY: usize = 40;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Curve {
    bytes: [f64; CURVE_CAPACITY],
    us: [f64; CURVE_CAPACITY],
    len: usize,
}

impl Curve {
    /// From samples (bytes, microseconds) in increasing size. Times are made
    /// non-decreasing (a running maximum), so that a larger group never
    /// costs less: measurement noise must not make the search's pruning
    /// (a longer group costs at least as much) unsound.
    pub fn new(samples: &[(u64, f64)]) -> Result<Self, PlanError> {
        let bad = |why: String| Err(PlanError::InvalidHardware(format!("curve: {why}")));
        if samples.len() < 2 || samples.len() > CURVE_CAPACITY {
            return bad(format!(
                "needs 2 to {CURVE_CAPACITY} samples, got {}",
                samples.len()
            ));
        }
        let mut curve = Self {
            bytes: [0.0; CURVE_CAPACITY],
            us: [0.0; CURVE_CAPACITY],
            len: samples.len(),
        };
        let mut floor = 0.0f64;
        for (i, &(bytes, us)) in samples.iter().enumerate() {
            if !(us.is_finite() && us > 0.0) {
                return bad(format!("sample {i}: time must be finite and > 0, got {us}"));
            }
            if i > 0 && bytes <= samples[i - 1].0 {
                return bad(format!(
                    "sample {i}: sizes must increase, got {bytes} after {}",
                    samples[i - 1].0
                ));
            }
            floor = floor.max(us);
            curve.bytes[i] = bytes as f64;
            curve.us[i] = floor;
        }
        Ok(curve)
    }

    pub fn samples(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        (0..self.len).map(|i| (self.bytes[i], self.us[i]))
    }

    /// Predicted time of a collective over `bytes`.
    pub fn at(&self, bytes: u64) -> f64 {
        let x = bytes as f64;
        let n = self.len;
        if x <= self.bytes[0] {
            return self.us[0];
        }
        // The segment holding x, or the last one past the end.
        let i = (1..n).find(|&i| x <= self.bytes[i]).unwrap_or(n - 1);
        let (x0, x1, y0, y1) = (self.bytes[i - 1], self.bytes[i], self.us[i - 1], self.us[i]);
        y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn interpolates_clamps_and_extrapolates() {
        let c = Curve::new(&[(1000, 10.0), (2000, 12.0), (4000, 20.0)]).unwrap();
        assert_eq!(c.at(0), 10.0);
        assert_eq!(c.at(1000), 10.0);
        assert!((c.at(1500) - 11.0).abs() < 1e-12);
        assert!((c.at(3000) - 16.0).abs() < 1e-12);
        // Past the end: the last segment's 4 us per 1000 bytes.
        assert!((c.at(6000) - 28.0).abs() < 1e-12);
    }

    #[test]
    fn noise_never_makes_more_bytes_cheaper() {
        let c = Curve::new(&[(1000, 10.0), (2000, 9.0), (4000, 20.0)]).unwrap();
        assert_eq!(c.at(2000), 10.0);
        assert!(c.at(1500) >= c.at(1000));
    }

    #[test]
    fn bad_samples_are_named() {
        for (samples, what) in [
            (vec![(1, 1.0)], "needs 2"),
            (vec![(1, 1.0), (1, 2.0)], "sizes must increase"),
            (vec![(1, 1.0), (2, f64::NAN)], "finite"),
            (vec![(1, 0.0), (2, 1.0)], "finite"),
            (vec![(0u64, 1.0); CURVE_CAPACITY + 1], "needs 2"),
        ] {
            match Curve::new(&samples) {
                Err(PlanError::InvalidHardware(why)) => assert!(why.contains(what), "{why}"),
                other => panic!("{samples:?}: {other:?}"),
            }
        }
    }

    proptest! {
        #[test]
        fn more_bytes_never_cost_less(
            times in prop::collection::vec(1.0f64..1000.0, 2..20),
            a in 0u64..1 << 32,
            b in 0u64..1 << 32,
        ) {
            let samples: Vec<(u64, f64)> =
                times.iter().enumerate().map(|(i, &t)| (4096u64 << i, t)).collect();
            let c = Curve::new(&samples).unwrap();
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(c.at(hi) >= c.at(lo));
        }
    }
}
