"""CPU count behind the s17 record: the drafter mask's open tiles and the distinct label positions
of one row built like bench/trainer.py's. Run: .venv/bin/python benchmarks/raw/small_targets_h200_20261203_s17/cpu_tile_and_label_count.py"""
import torch, random
from flashdraft.model.attention import BlockLayout, dflash_mask_mod, tile_maps
from flashdraft.train.blocks import sample_anchors
random.seed(0)
T=8192
docs=torch.full((T,),-1); pos=0; d=0
while True:
    L=random.randint(300,3000)
    if pos+L>T: break
    docs[pos:pos+L]=d; pos+=L; d+=1
loss=torch.zeros(T); 
# answer half of each doc is trained (approx)
for i in range(d):
    idx=(docs==i).nonzero().flatten(); loss[idx[len(idx)//3:]]=1
g=torch.Generator().manual_seed(0)
a,v=sample_anchors(loss,docs,512,g)
lay=BlockLayout(a[None],v[None],docs[None],16)
p,f=tile_maps(dflash_mask_mod(lay),1,8192,16384,torch.device('cpu'))
print('docs',d,'fill',pos,'valid anchors',int(v.sum()))
print('partial tiles',int(p.sum()),'full',int(f.sum()),'of',p.numel(), 'per q tile', (p.sum()+f.sum()).item()/64)
m=torch.nn.attention.flex_attention.create_mask(dflash_mask_mod(lay),1,None,8192,16384,device='cpu')
print('density of visited tiles', m.sum().item()/((p.sum()+f.sum()).item()*128*128))
from flashdraft.train.blocks import block_labels, label_positions
_, mask = block_labels(torch.zeros(1,512,15,dtype=torch.long), loss[None], docs[None], a[None], v[None], 16)
lp = label_positions(a[None],16,T)[0]
tr = mask[0,:,1:]>0
print('slots', tr.numel(), 'trained', int(tr.sum()), 'unique positions', lp.unique().numel(), 'unique trained positions', lp[tr].unique().numel())
