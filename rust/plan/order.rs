//! The sequence in which the persistent kernel visits tiles. Row-band order
//! finishes bands top to bottom, so every wave group covers contiguous output
//! rows and its AllReduce can run in place.

use super::tiles::OutputTiles;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderKind {
    /// Position p holds tile id p.
    RowBand,
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

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::output_tiles;

    proptest! {
        #[test]
        fn row_band_is_a_permutation_of_tile_ids(tiles in output_tiles()) {
            let order = TileOrder::row_band(&tiles);
            prop_assert_eq!(order.kind, OrderKind::RowBand);
            prop_assert_eq!(order.len(), tiles.count() as usize);
            let mut seen = vec![false; order.len()];
            for &id in &order.positions {
                prop_assert!(!std::mem::replace(&mut seen[id as usize], true));
            }
        }
    }
}
