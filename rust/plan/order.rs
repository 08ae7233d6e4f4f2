//! The sequence in which the persistent kernel visits tiles.
//!
//! Row-band order finishes bands top to bottom, so every wave group covers
//! contiguous output rows and its AllReduce runs in place. Rastered order
//! keeps that property (each group's tiles still come before the next
//! group's) but walks a group in blocks of `bands` row bands, column by
//! column inside a block: the CTAs running at one time then share fewer,
//! more reused A and B panels in L2 (132 CTAs over 8 x 16.5 tiles read ~half
//! the bytes of 4 x 32).

use super::error::PlanError;
use super::tiles::OutputTiles;
#[cfg(test)]
use super::tiles::TileShape;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderKind {
    /// Position p holds tile id p.
    RowBand,
    /// Blocks of up to `bands` row bands inside each group, column-major
    /// inside a block.
    Rastered { bands: u32 },
    /// Blocks of `bands` row bands over the whole output, whatever the
    /// groups: the staged (swizzled) schedule's order.
    Swizzled { bands: u32 },
}

/// `positions[p]` is the tile id the kernel computes at position p.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TileOrder {
    pub kind: OrderKind,
    pub positions: Vec<u32>,
}

impl TileOrder {
    pub fn row_band(tiles: &OutputTiles) -> Self {
        Self {
            kind: OrderKind::RowBand,
            positions: (0..tiles.count()).collect(),
        }
    }

    /// Rastered order inside groups of `band_counts` consecutive bands
    /// (summing to tiles.tiles_m); `bands` = 1 is the row-band order.
    pub fn rastered(
        tiles: &OutputTiles,
        band_counts: &[u32],
        bands: u32,
    ) -> Result<Self, PlanError> {
        if bands == 0 {
            return Err(PlanError::InvalidPartition(
                "raster bands must be >= 1, got 0".into(),
            ));
        }
        let total: u64 = band_counts.iter().map(|&c| u64::from(c)).sum();
        if total != u64::from(tiles.tiles_m) {
            return Err(PlanError::InvalidPartition(format!(
                "band counts sum to {total}, the output has {} row bands",
                tiles.tiles_m
            )));
        }
        if bands == 1 {
            return Ok(Self::row_band(tiles));
        }
        let mut positions = Vec::with_capacity(tiles.count() as usize);
        let mut first = 0u32;
        for &count in band_counts {
            let end = first + count;
            let mut block = first;
            while block < end {
                let block_end = (block + bands).min(end);
                for tn in 0..tiles.tiles_n {
                    positions.extend((block..block_end).map(|tm| tiles.id(tm, tn)));
                }
                block = block_end;
            }
            first = end;
        }
        Ok(Self {
            kind: OrderKind::Rastered { bands },
            positions,
        })
    }

    /// The raster over the whole output in blocks of `bands` bands, for
    /// groups that are runs of positions (the staged schedule).
    pub fn swizzled(tiles: &OutputTiles, bands: u32) -> Result<Self, PlanError> {
        let mut order = Self::rastered(tiles, &[tiles.tiles_m], bands)?;
        order.kind = OrderKind::Swizzled { bands };
        Ok(order)
    }

    /// Row bands per raster block (1: row by row).
    pub fn raster_bands(&self) -> u32 {
        match self.kind {
            OrderKind::RowBand => 1,
            OrderKind::Rastered { bands } | OrderKind::Swizzled { bands } => bands,
        }
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Whether position p holds tile p (the kernel then needs no table).
    pub fn is_identity(&self) -> bool {
        self.positions.iter().zip(0u32..).all(|(&t, p)| t == p)
    }

    /// `per_tile[id]` re-indexed by position: what the kernel reads at `pos`.
    pub fn by_position(&self, per_tile: &[u32]) -> Vec<u32> {
        self.positions
            .iter()
            .map(|&id| per_tile[id as usize])
            .collect()
    }
}

/// The raster block height (a power of two up to 32 bands) that minimises
/// the A and B panel bytes the `ctas` CTAs running at once read: a wave of
/// `ctas` positions spans `cols` tile columns and `ctas / cols` bands. Ties go
/// to the shorter block.
pub fn default_raster_bands(tiles: &OutputTiles, ctas: u32) -> u32 {
    let ctas = ctas.clamp(1, tiles.count().max(1));
    let panel_bytes = |bands: u32| {
        let cols = ctas.div_ceil(bands).min(tiles.tiles_n);
        let rows = ctas.div_ceil(cols);
        u64::from(rows) * u64::from(tiles.tile.bm) + u64::from(cols) * u64::from(tiles.tile.bn)
    };
    [1u32, 2, 4, 8, 16, 32]
        .into_iter()
        .filter(|&b| b == 1 || b <= tiles.tiles_m)
        .min_by_key(|&b| (panel_bytes(b), b))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::output_tiles;

    fn assert_permutation(order: &TileOrder, tiles: &OutputTiles) -> Result<(), TestCaseError> {
        prop_assert_eq!(order.len(), tiles.count() as usize);
        let mut seen = vec![false; order.len()];
        for &id in &order.positions {
            prop_assert!(!std::mem::replace(&mut seen[id as usize], true));
        }
        Ok(())
    }

    /// Splits tiles_m bands into groups of `per` (the last one shorter).
    fn counts(tiles_m: u32, per: u32) -> Vec<u32> {
        let mut v = vec![per; (tiles_m / per) as usize];
        if tiles_m % per != 0 {
            v.push(tiles_m % per);
        }
        v
    }

    proptest! {
        #[test]
        fn row_band_is_a_permutation_of_tile_ids(tiles in output_tiles()) {
            let order = TileOrder::row_band(&tiles);
            prop_assert_eq!(order.kind, OrderKind::RowBand);
            prop_assert!(order.is_identity());
            assert_permutation(&order, &tiles)?;
        }

        #[test]
        fn rastered_keeps_every_group_contiguous(
            tiles in output_tiles(), per in 1u32..40, bands in 1u32..20,
        ) {
            let band_counts = counts(tiles.tiles_m, per);
            let order = TileOrder::rastered(&tiles, &band_counts, bands).unwrap();
            assert_permutation(&order, &tiles)?;
            // Positions of group g are exactly its bands' tiles, before group g+1's.
            let mut p = 0usize;
            let mut first = 0u32;
            for &c in &band_counts {
                let n = (c * tiles.tiles_n) as usize;
                for &id in &order.positions[p..p + n] {
                    let tm = tiles.coords(id).0;
                    prop_assert!(tm >= first && tm < first + c);
                }
                p += n;
                first += c;
            }
        }
    }

    #[test]
    fn rastered_walks_blocks_column_by_column() {
        let t = crate::plan::testing::tiles(3 * 128, 2 * 128);
        let order = TileOrder::rastered(&t, &[3], 2).unwrap();
        // Block of bands 0-1: (0,0) (1,0) (0,1) (1,1); then band 2: (2,0) (2,1).
        assert_eq!(order.positions, vec![0, 2, 1, 3, 4, 5]);
        assert_eq!(order.kind, OrderKind::Rastered { bands: 2 });
        assert!(!order.is_identity());
        assert_eq!(
            order.by_position(&[10, 11, 12, 13, 14, 15]),
            vec![10, 12, 11, 13, 14, 15]
        );
    }

    #[test]
    fn default_raster_prefers_square_waves() {
        let tile = TileShape {
            bm: 128,
            bn: 256,
            bk: 64,
        };
        let t = |m| OutputTiles::new(m, 8192, tile).unwrap();
        // 132 CTAs over 32 tile columns: 16 bands x 9 columns read half the
        // panel bytes of 5 bands x 32 columns.
        assert_eq!(default_raster_bands(&t(8192), 132), 16);
        // One band: nothing to raster.
        assert_eq!(default_raster_bands(&t(128), 132), 1);
        let narrow = OutputTiles::new(8192, 256, tile).unwrap();
        assert_eq!(default_raster_bands(&narrow, 132), 1);
    }

    #[test]
    fn swizzled_rasters_across_group_boundaries() {
        let t = crate::plan::testing::tiles(3 * 128, 2 * 128);
        let order = TileOrder::swizzled(&t, 2).unwrap();
        assert_eq!(order.kind, OrderKind::Swizzled { bands: 2 });
        assert_eq!(order.positions, vec![0, 2, 1, 3, 4, 5]);
        assert_eq!(order.raster_bands(), 2);
        assert_eq!(TileOrder::swizzled(&t, 1).unwrap().raster_bands(), 1);
        assert!(TileOrder::swizzled(&t, 0).is_err());
    }

    #[test]
    fn rastered_rejects_bad_input() {
        let t = crate::plan::testing::tiles(1000, 1000);
        assert!(TileOrder::rastered(&t, &[t.tiles_m], 0).is_err());
        assert!(TileOrder::rastered(&t, &[t.tiles_m - 1], 4).is_err());
        assert_eq!(
            TileOrder::rastered(&t, &[t.tiles_m], 1).unwrap(),
            TileOrder::row_band(&t)
        );
    }
}
