//! Wave-aware token splitting (TokenWeave): a batch's tokens cut into two
//! halves so that one half's communication can run while the other half
//! computes. An even cut is not free: each half's GEMMs end in partial waves
//! of their own, so two halves can take a wave more than the whole batch (a
//! 2 x 0.6-wave batch split evenly runs 2 x 1 waves instead of 2). The cut
//! here falls on a row-band boundary of the GEMMs' tiles, so the halves hold
//! exactly the whole batch's tiles; among the cuts that keep the halves
//! within `skew` of even (the overlap needs them alike), it takes the one
//! whose halves run the layer's GEMMs in the fewest waves, each GEMM's waves
//! weighted by its K (a wave of tiles takes time in proportion to K), then
//! the most even, the larger half first (the half that communicates last,
//! with nothing left to hide it, is then the smaller).

use super::error::{require_positive, PlanError};
use super::tiles::TileShape;

/// Two halves of `first + second` tokens, first in token order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenSplit {
    pub first: u32,
    pub second: u32,
    /// Waves the halves run over all the GEMMs, and the whole batch.
    pub waves: u32,
    pub unsplit_waves: u32,
}

/// A GEMM of the layer: `n` output columns, `k` deep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerGemm {
    pub n: u32,
    pub k: u32,
}

struct Layer<'a> {
    gemms: &'a [LayerGemm],
    bm: u64,
    bn: u64,
    ctas: u64,
}

impl Layer<'_> {
    /// (waves, waves weighted by K) of the GEMMs on `rows` rows (0 rows: none).
    fn waves(&self, rows: u64) -> (u64, u64) {
        self.gemms.iter().fold((0, 0), |(w, wk), g| {
            let tiles = rows.div_ceil(self.bm) * u64::from(g.n).div_ceil(self.bn);
            let waves = tiles.div_ceil(self.ctas);
            (w + waves, wk + waves * u64::from(g.k))
        })
    }

    fn split_waves(&self, first: u64, tokens: u64) -> (u64, u64) {
        let (a, b) = (self.waves(first), self.waves(tokens - first));
        (a.0 + b.0, a.1 + b.1)
    }
}

/// The split of `tokens` for a layer of `gemms` (each with the tokens as its
/// rows) in `tile` tiles on `ctas` CTAs, the halves at most `skew` x tokens
/// apart (0 <= skew <= 1; where no band cut is that even, the most even
/// one); `None` where the batch has fewer than two row bands.
pub fn wave_aware_split(
    tokens: u32,
    gemms: &[LayerGemm],
    tile: TileShape,
    ctas: u32,
    skew: f64,
) -> Result<Option<TokenSplit>, PlanError> {
    require_positive("tokens", tokens, PlanError::InvalidShape)?;
    if gemms.is_empty() {
        return Err(PlanError::InvalidShape(
            "gemms must name at least one GEMM".into(),
        ));
    }
    for g in gemms {
        require_positive("gemm n", g.n, PlanError::InvalidShape)?;
        require_positive("gemm k", g.k, PlanError::InvalidShape)?;
    }
    require_positive("tile.bm", tile.bm, PlanError::InvalidShape)?;
    require_positive("tile.bn", tile.bn, PlanError::InvalidShape)?;
    require_positive("ctas", ctas, PlanError::InvalidHardware)?;
    if !(0.0..=1.0).contains(&skew) {
        return Err(PlanError::InvalidShape(format!(
            "skew must be in [0, 1], got {skew}"
        )));
    }
    let layer = Layer {
        gemms,
        bm: u64::from(tile.bm),
        bn: u64::from(tile.bn),
        ctas: u64::from(ctas),
    };
    let t = u64::from(tokens);
    let bands = t.div_ceil(layer.bm);
    if bands < 2 {
        return Ok(None);
    }
    // Band cuts j * bm (1 <= j < bands), the first half j bands. Ties of
    // evenness go to the larger first half.
    let distance = |j: u64| (2 * j * layer.bm).abs_diff(t);
    let evenness = |j: u64| (distance(j), std::cmp::Reverse(j));
    let middle = (t / (2 * layer.bm)).clamp(1, bands - 1);
    let most_even = [middle, (middle + 1).min(bands - 1)]
        .into_iter()
        .min_by_key(|&j| evenness(j))
        .expect("two candidates");
    // Halves at most skew x tokens apart; the most even cut always qualifies.
    // The window of such cuts, one band wider on each side for rounding (the
    // filter below is exact), scanned without allocating.
    let limit = (skew * t as f64).max(distance(most_even) as f64);
    let reach = (limit / (2 * layer.bm) as f64).ceil() as u64 + 1;
    let (lo, hi) = (
        most_even.saturating_sub(reach).max(1),
        most_even.saturating_add(reach).min(bands - 1),
    );
    let best = (lo..=hi)
        .filter(|&j| distance(j) as f64 <= limit)
        .min_by_key(|&j| (layer.split_waves(j * layer.bm, t).1, evenness(j)))
        .unwrap_or(most_even);
    let first = best * layer.bm;
    let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    Ok(Some(TokenSplit {
        first: narrow(first),
        second: narrow(t - first),
        waves: narrow(layer.split_waves(first, t).0),
        unsplit_waves: narrow(layer.waves(t).0),
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

    fn one(n: u32) -> Vec<LayerGemm> {
        vec![LayerGemm { n, k: 1 }]
    }

    fn split(tokens: u32, gemms: &[LayerGemm], ctas: u32, skew: f64) -> TokenSplit {
        wave_aware_split(tokens, gemms, TILE, ctas, skew)
            .unwrap()
            .unwrap()
    }

    #[test]
    fn even_batch_of_whole_waves_splits_in_half() {
        // 4096 x 8192: 32 bands x 32 columns = 1024 tiles on 128 CTAs, 8 waves.
        let s = split(4096, &one(8192), 128, 0.25);
        assert_eq!(
            (s.first, s.second, s.waves, s.unsplit_waves),
            (2048, 2048, 8, 8)
        );
    }

    #[test]
    fn even_cut_that_costs_a_wave_is_moved() {
        // 1536 tokens x 8192 on 132 CTAs: 12 bands x 32 = 384 tiles, 3 waves.
        // In half (6 bands, 192 tiles) each half takes 2 waves: 4 in all;
        // 4 bands (128 tiles, one wave) + 8 bands (256 tiles, two) keep 3,
        // but only a skew of 1/3 allows that cut.
        let s = split(1536, &one(8192), 132, 1.0 / 3.0);
        assert_eq!(
            (s.first, s.second, s.waves, s.unsplit_waves),
            (1024, 512, 3, 3)
        );
        let s = split(1536, &one(8192), 132, 0.25);
        assert_eq!((s.first, s.second, s.waves), (768, 768, 4));
    }

    #[test]
    fn every_gemm_of_the_layer_counts_by_its_k() {
        // 3072 tokens. gate_up (28672 wide, K 8192) alone: 1792 + 1280 saves
        // a wave over 1536 + 1536; o_proj and down (8192 wide, K 4096 and
        // 14336) each lose one there, which outweighs it.
        let gate_up = LayerGemm { n: 28672, k: 8192 };
        let s = split(3072, &[gate_up], 132, 0.25);
        assert_eq!((s.first, s.waves, s.unsplit_waves), (1792, 21, 21));
        let layer = [
            LayerGemm { n: 8192, k: 4096 },
            gate_up,
            LayerGemm { n: 8192, k: 14336 },
        ];
        let s = split(3072, &layer, 132, 0.25);
        assert_eq!((s.first, s.second), (1536, 1536));
        assert_eq!((s.waves, s.unsplit_waves), (22 + 6 + 6, 21 + 6 + 6));
    }

    #[test]
    fn ties_put_the_larger_half_first() {
        // 3 bands, one wave however cut: 2 bands then 1.
        let s = split(384, &one(256), 132, 0.0);
        assert_eq!((s.first, s.second), (256, 128));
        assert_eq!(s.waves, 2);
    }

    #[test]
    fn a_partial_band_stays_in_the_second_half() {
        let s = split(1000, &one(4096), 132, 0.25);
        assert_eq!(s.first % 128, 0);
        assert_eq!(s.first + s.second, 1000);
    }

    #[test]
    fn fewer_than_two_bands_do_not_split() {
        assert_eq!(
            wave_aware_split(128, &one(8192), TILE, 132, 0.25).unwrap(),
            None
        );
        assert_eq!(
            wave_aware_split(1, &one(8192), TILE, 132, 0.25).unwrap(),
            None
        );
        assert!(wave_aware_split(129, &one(8192), TILE, 132, 0.25)
            .unwrap()
            .is_some());
    }

    #[test]
    fn the_largest_batch_is_cut_quickly() {
        // The scan covers the window of cuts within the skew only, with no
        // list of every band: 2^32 - 1 tokens are 33.5 M bands.
        let start = std::time::Instant::now();
        let s = split(u32::MAX, &one(8192), 132, 0.01);
        assert_eq!(
            u64::from(s.first) + u64::from(s.second),
            u64::from(u32::MAX)
        );
        assert!(
            (2 * u64::from(s.first)).abs_diff(u64::from(u32::MAX)) <= u64::from(u32::MAX) / 100
        );
        assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
    }

    #[test]
    fn bad_arguments_are_rejected() {
        let shape =
            |r: Result<Option<TokenSplit>, PlanError>| matches!(r, Err(PlanError::InvalidShape(_)));
        assert!(shape(wave_aware_split(0, &one(8192), TILE, 132, 0.25)));
        assert!(shape(wave_aware_split(1024, &one(0), TILE, 132, 0.25)));
        assert!(shape(wave_aware_split(1024, &[], TILE, 132, 0.25)));
        assert!(shape(wave_aware_split(
            1024,
            &[LayerGemm { n: 8, k: 0 }],
            TILE,
            132,
            0.25
        )));
        for skew in [-0.1, 1.5, f64::NAN] {
            assert!(shape(wave_aware_split(1024, &one(8192), TILE, 132, skew)));
        }
        assert!(matches!(
            wave_aware_split(1024, &one(8192), TILE, 0, 0.25),
            Err(PlanError::InvalidHardware(_))
        ));
    }

    proptest! {
        #[test]
        fn split_is_the_cheapest_band_cut_within_the_skew(
            tokens in 129u32..40_000,
            gemms in prop::collection::vec((1u32..30_000, 1u32..20_000), 1..4),
            ctas in 1u32..=132,
            skew in 0.0f64..=1.0,
        ) {
            let gemms: Vec<LayerGemm> = gemms.into_iter().map(|(n, k)| LayerGemm { n, k }).collect();
            let s = split(tokens, &gemms, ctas, skew);
            let cost = |rows: u32| -> (u64, u64) {
                gemms.iter().fold((0, 0), |(w, wk), g| {
                    let tiles = u64::from(rows.div_ceil(128)) * u64::from(g.n.div_ceil(256));
                    let waves = tiles.div_ceil(u64::from(ctas));
                    (w + waves, wk + waves * u64::from(g.k))
                })
            };
            let of = |first: u32| {
                let (a, b) = (cost(first), cost(tokens - first));
                (a.0 + b.0, a.1 + b.1)
            };
            prop_assert_eq!(s.first + s.second, tokens);
            prop_assert!(s.first > 0 && s.second > 0);
            prop_assert_eq!(s.first % TILE.bm, 0);
            prop_assert_eq!(u64::from(s.waves), of(s.first).0);
            prop_assert_eq!(u64::from(s.unsplit_waves), cost(tokens).0);
            let skew_of = |first: u32| (2 * first).abs_diff(tokens);
            let cuts: Vec<u32> = (1..tokens.div_ceil(128)).map(|j| j * 128).collect();
            let most_even = cuts.iter().map(|&c| skew_of(c)).min().unwrap();
            let limit = (skew * f64::from(tokens)).max(f64::from(most_even));
            prop_assert!(f64::from(skew_of(s.first)) <= limit);
            // No cut within the limit is cheaper, or as cheap and more even.
            for &c in cuts.iter().filter(|&&c| f64::from(skew_of(c)) <= limit) {
                prop_assert!(of(c).1 >= of(s.first).1);
                if of(c).1 == of(s.first).1 {
                    prop_assert!(skew_of(c) >= skew_of(s.first));
                }
            }
        }
    }
}
