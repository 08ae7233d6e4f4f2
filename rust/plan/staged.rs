//! Wave groups of the swizzled schedule: runs of whole waves of positions in
//! an L2 raster over the whole output, not whole row bands. Such a group's
//! outputs are scattered over `out`, so the GEMM stores every tile into a
//! staging buffer at its position instead (tile at position p in rows
//! p*bm..+bm of a [tiles * bm, bn] buffer): each group is then one contiguous
//! block there, its collective runs in place on it, and an un-reorder copy
//! moves it into `out` afterwards. This is FlashOverlap's reordering; it buys
//! groups of any number of waves and a raster that group boundaries do not
//! cut, for an extra read and write of the output.

use std::ops::Range;

use super::error::PlanError;
use super::groups::CollectiveSlice;
use super::tiles::OutputTiles;
use super::waves::Waves;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedGroup {
    /// Positions of the tile order whose tiles the group waits for.
    pub positions: Range<u32>,
    /// Whole waves the group spans (the last wave may be partial).
    pub waves: Range<u32>,
    pub tiles: u32,
    /// The group's block of the staging buffer, in elements.
    pub slice: CollectiveSlice,
}

/// Consecutive groups covering every wave, in position order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedPartition {
    pub groups: Vec<StagedGroup>,
}

/// Elements of one staged tile (tails included: staged tiles are whole).
pub fn tile_elems(tiles: &OutputTiles) -> u64 {
    u64::from(tiles.tile.bm) * u64::from(tiles.tile.bn)
}

/// Elements of the staging buffer for `tiles`.
pub fn staging_elems(tiles: &OutputTiles) -> u64 {
    u64::from(tiles.count()) * tile_elems(tiles)
}

impl StagedPartition {
    /// wave_counts[g] = number of consecutive waves of `waves` in group g;
    /// all >= 1, summing to waves.count().
    pub fn from_wave_counts(
        tiles: &OutputTiles,
        waves: &Waves,
        wave_counts: &[u32],
    ) -> Result<Self, PlanError> {
        if waves.tiles != tiles.count() {
            return Err(PlanError::InvalidPartition(format!(
                "waves must cover the {} tiles of the output, got {}",
                tiles.count(),
                waves.tiles
            )));
        }
        if wave_counts.is_empty() || wave_counts.contains(&0) {
            return Err(PlanError::InvalidPartition(format!(
                "wave_counts must all be >= 1 and name at least one group, got {wave_counts:?}"
            )));
        }
        let total: u64 = wave_counts.iter().map(|&c| u64::from(c)).sum();
        if total != u64::from(waves.count()) {
            return Err(PlanError::InvalidPartition(format!(
                "wave_counts must sum to the {} waves, got {total}",
                waves.count()
            )));
        }
        let per_tile = tile_elems(tiles);
        let mut first = 0u32;
        let groups = wave_counts
            .iter()
            .map(|&count| {
                let span = first..first + count;
                let positions =
                    waves.positions(span.start).start..waves.positions(span.end - 1).end;
                first += count;
                let tiles = positions.end - positions.start;
                StagedGroup {
                    slice: CollectiveSlice {
                        offset: u64::from(positions.start) * per_tile,
                        count: u64::from(tiles) * per_tile,
                    },
                    positions,
                    waves: span,
                    tiles,
                }
            })
            .collect();
        Ok(Self { groups })
    }

    pub fn wave_counts(&self) -> Vec<u32> {
        self.groups.iter().map(|g| g.waves.len() as u32).collect()
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Group id of every position (what the kernel reads: positions, not
    /// tiles, decide a staged group).
    pub fn group_by_position(&self) -> Vec<u32> {
        (0u32..)
            .zip(&self.groups)
            .flat_map(|(g, group)| group.positions.clone().map(move |_| g))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{ctas, output_tiles, tiles};

    #[test]
    fn groups_are_contiguous_blocks_of_the_staging_buffer() {
        let t = tiles(1000, 1000); // 8 x 8 tiles of 128 x 128
        let waves = Waves::new(20, t.count()).unwrap(); // 4 waves, the last of 4 tiles
        let p = StagedPartition::from_wave_counts(&t, &waves, &[1, 3]).unwrap();
        assert_eq!(p.groups[0].positions, 0..20);
        assert_eq!(p.groups[1].positions, 20..64);
        assert_eq!(p.groups[1].tiles, 44);
        assert_eq!(p.groups[1].slice.offset, 20 * 128 * 128);
        assert_eq!(p.groups[1].slice.count, 44 * 128 * 128);
        assert_eq!(staging_elems(&t), 64 * 128 * 128);
        assert_eq!(p.wave_counts(), [1, 3]);
        let table = p.group_by_position();
        assert_eq!(table.len(), 64);
        assert!(table[..20].iter().all(|&g| g == 0) && table[20..].iter().all(|&g| g == 1));
    }

    #[test]
    fn bad_wave_counts_are_rejected() {
        let t = tiles(1000, 1000);
        let waves = Waves::new(20, t.count()).unwrap();
        for counts in [&[][..], &[2, 0, 2], &[2, 1], &[3, 2]] {
            assert!(
                StagedPartition::from_wave_counts(&t, &waves, counts).is_err(),
                "{counts:?}"
            );
        }
        let other = Waves::new(20, 10).unwrap();
        assert!(StagedPartition::from_wave_counts(&t, &other, &[1]).is_err());
    }

    proptest! {
        #[test]
        fn groups_cover_every_position_once(
            tiles in output_tiles(), ctas in ctas(), per in 1u32..9,
        ) {
            let waves = Waves::new(ctas, tiles.count()).unwrap();
            let mut counts = vec![per; (waves.count() / per) as usize];
            if waves.count() % per != 0 {
                counts.push(waves.count() % per);
            }
            let p = StagedPartition::from_wave_counts(&tiles, &waves, &counts).unwrap();
            let (mut position, mut offset) = (0u32, 0u64);
            for g in &p.groups {
                prop_assert_eq!(g.positions.start, position);
                prop_assert_eq!(g.slice.offset, offset);
                prop_assert_eq!(g.slice.count, u64::from(g.tiles) * tile_elems(&tiles));
                position = g.positions.end;
                offset += g.slice.count;
            }
            prop_assert_eq!(position, tiles.count());
            prop_assert_eq!(offset, staging_elems(&tiles));
        }
    }
}
