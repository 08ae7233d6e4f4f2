//! How positions map to time. A persistent kernel with `ctas` CTAs hands
//! position p to CTA p % ctas, so position p completes in wave p / ctas, and
//! waves are the granularity at which groups of tiles become ready.

use std::ops::Range;

use super::error::{require_positive, PlanError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waves {
    pub ctas: u32,
    pub tiles: u32,
}

impl Waves {
    pub fn new(ctas: u32, tiles: u32) -> Result<Self, PlanError> {
        require_positive("ctas", ctas, PlanError::InvalidHardware)?;
        require_positive("tiles", tiles, PlanError::InvalidShape)?;
        Ok(Self { ctas, tiles })
    }

    pub fn count(&self) -> u32 {
        self.tiles.div_ceil(self.ctas)
    }

    pub fn wave_of(&self, position: u32) -> u32 {
        position / self.ctas
    }

    /// Positions completed in `wave`; the last wave may be partial, later ones are empty.
    pub fn positions(&self, wave: u32) -> Range<u32> {
        let clip = |p: u64| p.min(u64::from(self.tiles)) as u32;
        let start = u64::from(wave) * u64::from(self.ctas);
        clip(start)..clip(start + u64::from(self.ctas))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn last_wave_is_partial() {
        let waves = Waves::new(4, 10).unwrap();
        assert_eq!(waves.count(), 3);
        assert_eq!(waves.positions(2), 8..10);
        assert!(waves.positions(3).is_empty());
    }

    #[test]
    fn zero_ctas_or_tiles_are_rejected() {
        assert!(matches!(
            Waves::new(0, 10),
            Err(PlanError::InvalidHardware(_))
        ));
        assert!(matches!(Waves::new(4, 0), Err(PlanError::InvalidShape(_))));
    }

    proptest! {
        #[test]
        fn every_position_in_exactly_one_wave(ctas in 1u32..=132, tiles in 1u32..100_000) {
            let waves = Waves::new(ctas, tiles).unwrap();
            let mut next = 0;
            for wave in 0..waves.count() {
                let positions = waves.positions(wave);
                prop_assert_eq!(positions.start, next);
                prop_assert!(!positions.is_empty());
                for p in positions.clone() {
                    prop_assert_eq!(waves.wave_of(p), wave);
                }
                next = positions.end;
            }
            prop_assert_eq!(next, tiles);
        }
    }
}
