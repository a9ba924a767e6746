(function(){var svg=document.getElementById('timeline');if(!svg)return;var on=null;
document.querySelectorAll('.legend-item').forEach(function(el){el.addEventListener('click',function(){
var r=el.getAttribute('data-release');on=(on===r)?null:r;svg.classList.toggle('focus',on!==null);
svg.querySelectorAll('[data-release]').forEach(function(x){x.classList.toggle('hl',on!==null&&x.getAttribute('data-release')===on);});
svg.querySelectorAll('.marker').forEach(function(m){m.classList.toggle('hl',on!==null&&m.getAttribute('data-release')===on);});});});
document.body.setAttribute('data-rendered','true');})();
