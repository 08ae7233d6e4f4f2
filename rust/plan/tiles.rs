//! The output matrix cut into the tiles the GEMM kernel computes. Tiles are
//! numbered row-major so that a run of whole row bands is one contiguous
//! block of `out`, which is what an in-place collective needs.

use std::ops::Range;

use super::error::{require_positive, PlanError};

/// One CTA's unit of work: `bm` x `bn` outputs, accumulated `bk` deep at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TileShape {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
}

/// `out[m, n]` covered by `tiles_m` x `tiles_n` tiles; the last row band and
/// the last tile column may be partial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputTiles {
    pub m: u32,
    pub n: u32,
    pub tile: TileShape,
    pub tiles_m: u32,
    pub tiles_n: u32,
}

impl OutputTiles {
    pub fn new(m: u32, n: u32, tile: TileShape) -> Result<Self, PlanError> {
        for (field, value) in [
            ("m", m),
            ("n", n),
            ("tile.bm", tile.bm),
            ("tile.bn", tile.bn),
            ("tile.bk", tile.bk),
        ] {
            require_positive(field, value, PlanError::InvalidShape)?;
        }
        let tiles_m = m.div_ceil(tile.bm);
        let tiles_n = n.div_ceil(tile.bn);
        // Tile ids and positions are u32 on the device too.
        if u64::from(tiles_m) * u64::from(tiles_n) > u64::from(u32::MAX) {
            return Err(PlanError::InvalidShape(format!(
                "tile count must fit in u32, got {tiles_m} x {tiles_n} tiles"
            )));
        }
        Ok(Self {
            m,
            n,
            tile,
            tiles_m,
            tiles_n,
        })
    }

    pub fn count(&self) -> u32 {
        self.tiles_m * self.tiles_n
    }

    /// `(tm, tn)` of a tile id below `count()`.
    pub fn coords(&self, id: u32) -> (u32, u32) {
        (id / self.tiles_n, id % self.tiles_n)
    }

    pub fn id(&self, tm: u32, tn: u32) -> u32 {
        tm * self.tiles_n + tn
    }

    /// Output rows of row band `tm`, clipped to `m`; empty past the last band.
    pub fn band_rows(&self, tm: u32) -> Range<u32> {
        let clip = |row: u64| row.min(u64::from(self.m)) as u32;
        let start = u64::from(tm) * u64::from(self.tile.bm);
        clip(start)..clip(start + u64::from(self.tile.bm))
    }
}

/// The tile width (BN) of the Hopper kernel when the caller names none: 256
/// on every shape but the few [`hopper_tile_n`] narrows. Over the 17 shapes of evaluation/gemm_tile_sweep.py at the
/// planner's raster, 128-wide tiles ran 1.039x cuBLAS on H200 (256-wide:
/// 1.034x) but 0.85x on H100 (0.59x worst, at M >= 8192), where 256-wide
/// ones ran 1.03x (1.00x worst): a small gain on one GPU is not worth a large
/// loss on its sibling.
pub const HOPPER_TILE_N: u32 = 256;

/// Where 128-wide tiles must save over 256-wide ones to be taken by
/// [`hopper_tile_n`]: a tenth of the waves.
pub const NARROW_TILES_MARGIN: f64 = 0.9;

/// The Hopper tile width for an `m` x `n` output on `ctas` CTAs: 256
/// ([`HOPPER_TILE_N`]), unless 256-wide tiles leave so many SMs idle that
/// 128-wide ones (half the work each, twice as many) run in at most 0.9x
/// the time, counting whole waves: e.g. 768 x 8192 on 132 SMs is 192 wide
/// tiles (2 waves, 4 narrow-tile times) or 384 narrow ones (3 waves). On
/// one H200 and one H100 (evaluation/gemm_small_m.py, 24 shapes of M <= 2048)
/// it picks 128 on 8 shapes, each faster that way on both GPUs (up to 1.9x),
/// and 256 on every shape of M = 2048 that H100 times slower in 128. Used
/// where the caller names no kernel for the GEMM alone (`flashoverlap.gemm`);
/// the overlapped ops choose by their profile's timings instead.
pub fn hopper_tile_n(m: u32, n: u32, ctas: u32) -> u32 {
    let bands = u64::from(m.div_ceil(128));
    let ctas = u64::from(ctas.max(1));
    // Time in narrow-tile units: a wide tile is two.
    let wide = (bands * u64::from(n.div_ceil(256))).div_ceil(ctas) * 2;
    let narrow = (bands * u64::from(n.div_ceil(128))).div_ceil(ctas);
    if (narrow as f64) <= NARROW_TILES_MARGIN * wide as f64 {
        128
    } else {
        HOPPER_TILE_N
    }
}

/// Rows a row table may name: below 2**30, the bit above marking a
/// [`dual_row`] (the kernel's FO_DUAL_STORE).
pub const MAX_TABLE_ROWS: u64 = 1 << 30;

/// A row table's store row for a tile the push backend sends to row
/// `slot_row` (< [`MAX_TABLE_ROWS`]) of the peer's staging slot instead of
/// storing it here: -r - 1, as the kernel reads the table (i32, two's
/// complement).
pub fn pushed_row(slot_row: u64) -> u32 {
    debug_assert!(slot_row < MAX_TABLE_ROWS, "slot row {slot_row}");
    negated(slot_row)
}

/// -r - 1 as the kernel reads a table row (i32, two's complement).
fn negated(row: u64) -> u32 {
    (-(row as i64) - 1) as i32 as u32
}

/// A row table's store row for a tile the push backend both stores here, at
/// the row it loads (an All-to-All band holding this rank's rows and the
/// peer's, in the natural layout where the send buffer is x's row order),
/// and sends to row `slot_row` of the peer's slot.
pub fn dual_row(slot_row: u64) -> u32 {
    debug_assert!(slot_row < MAX_TABLE_ROWS, "slot row {slot_row}");
    // The marker bit is set on purpose: not a pushed row's (which asserts it clear).
    negated(slot_row | MAX_TABLE_ROWS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn narrow_tiles_only_where_wide_ones_idle_the_sms() {
        // (m, n, width) on 132 SMs, from the shapes timed on H200 and H100.
        for (m, n, bn) in [
            (256, 8192, 128),
            (256, 5120, 128),
            (256, 28672, 256),
            (512, 28672, 128),
            (512, 5120, 256),
            (768, 8192, 128),
            (768, 28672, 256),
            (1024, 5120, 128),
            (1024, 28672, 256),
            (1536, 28672, 256),
            (2048, 5120, 128),
            (2048, 8192, 256),
            (2048, 28672, 256),
            (16384, 8192, 256),
            (8192, 8192, 256),
        ] {
            assert_eq!(hopper_tile_n(m, n, 132), bn, "{m} x {n}");
        }
        assert_eq!(hopper_tile_n(1, 8, 0), 128);
    }

    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::output_tiles;

    const TILE: TileShape = TileShape {
        bm: 128,
        bn: 64,
        bk: 32,
    };

    #[test]
    fn partial_last_band_and_column() {
        let tiles = OutputTiles::new(300, 130, TILE).unwrap();
        assert_eq!((tiles.tiles_m, tiles.tiles_n, tiles.count()), (3, 3, 9));
        assert_eq!(tiles.band_rows(1), 128..256);
        assert_eq!(tiles.band_rows(2), 256..300);
        assert!(tiles.band_rows(3).is_empty());
        assert_eq!(tiles.coords(5), (1, 2));
        assert_eq!(tiles.id(1, 2), 5);
    }

    #[test]
    fn zero_dimensions_are_rejected_by_name() {
        let zero_bk = TileShape { bk: 0, ..TILE };
        for (m, n, tile, field) in [
            (0, 8, TILE, "m"),
            (8, 0, TILE, "n"),
            (8, 8, zero_bk, "tile.bk"),
        ] {
            match OutputTiles::new(m, n, tile) {
                Err(PlanError::InvalidShape(why)) => assert!(why.starts_with(field), "{why}"),
                other => panic!("expected InvalidShape for {field}, got {other:?}"),
            }
        }
    }

    #[test]
    fn tile_count_must_fit_u32() {
        let unit = TileShape {
            bm: 1,
            bn: 1,
            bk: 1,
        };
        assert!(matches!(
            OutputTiles::new(u32::MAX, 2, unit),
            Err(PlanError::InvalidShape(_))
        ));
    }

    proptest! {
        #[test]
        fn count_and_ids_round_trip(tiles in output_tiles(), pick in any::<u32>()) {
            prop_assert_eq!(tiles.count(), tiles.tiles_m * tiles.tiles_n);
            let id = pick % tiles.count();
            let (tm, tn) = tiles.coords(id);
            prop_assert!(tm < tiles.tiles_m && tn < tiles.tiles_n);
            prop_assert_eq!(tiles.id(tm, tn), id);
        }

        #[test]
        fn bands_cover_every_row_once(tiles in output_tiles()) {
            let mut next_row = 0;
            for tm in 0..tiles.tiles_m {
                let rows = tiles.band_rows(tm);
                prop_assert_eq!(rows.start, next_row);
                prop_assert!(!rows.is_empty() && rows.len() <= tiles.tile.bm as usize);
                next_row = rows.end;
            }
            prop_assert_eq!(next_row, tiles.m);
        }
    }
}
