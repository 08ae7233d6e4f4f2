//! Generators shared by the property tests, spanning the shapes the op is
//! used at: m up to 20000, n a multiple of 8 up to 20000, 64 or 128 tiles.

use proptest::prelude::*;

use super::gemm_all_reduce::{ModeRequest, OrderRequest, PlanRequest};
use super::tiles::{OutputTiles, TileShape};

/// The tile of the shipped kernel.
pub(crate) const TILE: TileShape = TileShape {
    bm: 128,
    bn: 128,
    bk: 64,
};

pub(crate) fn tiles(m: u32, n: u32) -> OutputTiles {
    OutputTiles::new(m, n, TILE).expect("valid test shape")
}

pub(crate) fn request(m: u32, n: u32, k: u32, world: u32) -> PlanRequest {
    PlanRequest {
        m,
        n,
        k,
        world,
        elem_bytes: 2,
        tile: TILE,
        reserved_sms: 12,
        bands_per_group: None,
        max_groups: 32,
        mode: ModeRequest::Auto,
        raster_bands: Some(4),
        order: OrderRequest::Banded,
    }
}

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
