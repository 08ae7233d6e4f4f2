//! Wave-aware token splitting (TokenWeave): a batch's tokens cut into two
//! halves so that one half's communication can run while the other half
//! computes. An even cut is not free: each half's GEMM ends in its own
//! partial wave, so two halves can take one wave more than the whole batch
//! (a 2 x 0.6-wave batch split evenly runs 2 x 1 waves instead of 2). The cut
//! here falls on a row-band boundary of the GEMM's tiles, so the halves hold
//! exactly the whole batch's tiles, and among those cuts it keeps the fewest
//! waves in total, then the most even halves.

use super::error::{require_positive, PlanError};
use super::tiles::TileShape;

/// Two halves of `first + second` tokens, first in token order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSplit {
    pub first: u32,
    pub second: u32,
    /// Waves the halves' GEMMs run together, and the whole batch's GEMM alone.
    pub waves: u32,
    pub unsplit_waves: u32,
}

/// Waves of a GEMM with `rows` output rows cut into `tile` tiles, `tiles_n`
/// tile columns, on `ctas` CTAs (0 rows: none).
fn waves(rows: u64, tile_m: u64, tiles_n: u64, ctas: u64) -> u64 {
    (rows.div_ceil(tile_m) * tiles_n).div_ceil(ctas)
}

/// The split of `tokens` for a GEMM with `n` output columns cut into `tile`
/// tiles on `ctas` CTAs; `None` where the batch has fewer than two row bands
/// (halves would add tiles, not hide anything).
pub fn wave_aware_split(
    tokens: u32,
    n: u32,
    tile: TileShape,
    ctas: u32,
) -> Result<Option<TokenSplit>, PlanError> {
    require_positive("tokens", tokens, PlanError::InvalidShape)?;
    require_positive("n", n, PlanError::InvalidShape)?;
    require_positive("tile.bm", tile.bm, PlanError::InvalidShape)?;
    require_positive("tile.bn", tile.bn, PlanError::InvalidShape)?;
    require_positive("ctas", ctas, PlanError::InvalidHardware)?;
    let (t, bm, ctas) = (u64::from(tokens), u64::from(tile.bm), u64::from(ctas));
    let tiles_n = u64::from(n.div_ceil(tile.bn));
    let bands = t.div_ceil(bm);
    if bands < 2 {
        return Ok(None);
    }
    let unsplit = waves(t, bm, tiles_n, ctas);
    let total = |j: u64| waves(j * bm, bm, tiles_n, ctas) + waves(t - j * bm, bm, tiles_n, ctas);
    // Cuts by distance from the even split, the first half's larger one
    // first on a tie (the half that communicates last is then the smaller):
    // the first cut that loses no wave is the answer; none does only on
    // batches of a few waves, where the scan over every band is short anyway.
    let mut order: Vec<u64> = (1..bands).collect();
    order.sort_by_key(|&j| ((2 * j * bm).abs_diff(t), std::cmp::Reverse(j)));
    let mut best = order[0];
    for &j in &order {
        if total(j) < total(best) {
            best = j;
        }
        if total(best) == unsplit {
            break;
        }
    }
    let first = best * bm;
    let narrow = |v: u64| u32::try_from(v).expect("bounded by tokens");
    Ok(Some(TokenSplit {
        first: narrow(first),
        second: narrow(t - first),
        waves: narrow(total(best)),
        unsplit_waves: narrow(unsplit),
    }))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const TILE: TileShape = TileShape {
        bm: 128,
        bn: 256,
        bk: 64,
    };

    fn split(tokens: u32, n: u32, ctas: u32) -> TokenSplit {
        wave_aware_split(tokens, n, TILE, ctas).unwrap().unwrap()
    }

    #[test]
    fn even_batch_of_whole_waves_splits_in_half() {
        // 4096 x 8192: 32 bands x 32 columns = 1024 tiles on 128 CTAs, 8 waves.
        let s = split(4096, 8192, 128);
        assert_eq!(
            (s.first, s.second, s.waves, s.unsplit_waves),
            (2048, 2048, 8, 8)
        );
    }

    #[test]
    fn even_cut_that_costs_a_wave_is_moved() {
        // 1536 tokens x 8192 on 132 CTAs: 12 bands x 32 = 384 tiles, 3 waves.
        // In half (6 bands, 192 tiles) each half takes 2 waves: 4 in all;
        // 4 bands (128 tiles, one wave) + 8 bands (256 tiles, two) keep 3.
        let s = split(1536, 8192, 132);
        assert_eq!(s.unsplit_waves, 3);
        assert_eq!(s.waves, 3);
        assert_eq!((s.first, s.second), (1024, 512));
        let even = waves(768, 128, 32, 132) * 2;
        assert_eq!(even, 4);
    }

    #[test]
    fn ties_put_the_larger_half_first() {
        // 3 bands, one wave however cut: 2 bands then 1.
        let s = split(384, 256, 132);
        assert_eq!((s.first, s.second), (256, 128));
        assert_eq!(s.waves, 2);
    }

    #[test]
    fn a_partial_band_stays_in_the_second_half() {
        let s = split(1000, 4096, 132);
        assert_eq!(s.first % 128, 0);
        assert_eq!(s.first + s.second, 1000);
    }

    #[test]
    fn fewer_than_two_bands_do_not_split() {
        assert_eq!(wave_aware_split(128, 8192, TILE, 132).unwrap(), None);
        assert_eq!(wave_aware_split(1, 8192, TILE, 132).unwrap(), None);
        assert!(wave_aware_split(129, 8192, TILE, 132).unwrap().is_some());
    }

    #[test]
    fn zero_sizes_are_rejected() {
        assert!(matches!(
            wave_aware_split(0, 8192, TILE, 132),
            Err(PlanError::InvalidShape(_))
        ));
        assert!(matches!(
            wave_aware_split(1024, 0, TILE, 132),
            Err(PlanError::InvalidShape(_))
        ));
        assert!(matches!(
            wave_aware_split(1024, 8192, TILE, 0),
            Err(PlanError::InvalidHardware(_))
        ));
    }

    proptest! {
        #[test]
        fn split_is_a_band_cut_with_the_fewest_waves_then_the_most_even(
            tokens in 129u32..40_000, n in 1u32..30_000, ctas in 1u32..=132,
        ) {
            let s = split(tokens, n, ctas);
            let tiles_n = u64::from(n.div_ceil(TILE.bn));
            let w = |rows: u32| waves(u64::from(rows), 128, tiles_n, u64::from(ctas));
            prop_assert_eq!(s.first + s.second, tokens);
            prop_assert!(s.first > 0 && s.second > 0);
            prop_assert_eq!(s.first % TILE.bm, 0);
            prop_assert_eq!(u64::from(s.waves), w(s.first) + w(s.second));
            prop_assert_eq!(u64::from(s.unsplit_waves), w(tokens));
            prop_assert!(s.waves >= s.unsplit_waves);
            // No band cut has fewer waves, or as few and more even halves.
            let mut first = TILE.bm;
            while first < tokens {
                let total = w(first) + w(tokens - first);
                prop_assert!(total >= u64::from(s.waves));
                if total == u64::from(s.waves) {
                    prop_assert!(
                        (2 * first).abs_diff(tokens) >= (2 * s.first).abs_diff(tokens)
                    );
                }
                first += TILE.bm;
            }
        }
    }
}
