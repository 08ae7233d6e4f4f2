//! Generators shared by the property tests, spanning the shapes the op is
//! used at: m up to 20000, n a multiple of 8 up to 20000, 64 or 128 tiles.

use proptest::prelude::*;

use super::tiles::{OutputTiles, TileShape};

pub(crate) fn output_tiles() -> impl Strategy<Value = OutputTiles> {
    let side = || prop::sample::select(vec![64u32, 128]);
    (1u32..20000, 1u32..=2500, side(), side()).prop_map(|(m, n8, bm, bn)| {
        OutputTiles::new(m, n8 * 8, TileShape { bm, bn, bk: 64 }).expect("generated shape")
    })
}

pub(crate) fn ctas() -> impl Strategy<Value = u32> {
    1u32..=132
}

pub(crate) fn world() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![2u32, 4, 8])
}
